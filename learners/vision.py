"""The learner's side of vision-language models: image bytes → per-row pixels → the forward.

Rank 0 recomputes each group's pixels from its images' bytes (``asyncrl.wire.images``) with the
image processor saved beside the model, the one the engines use (:mod:`asyncrl.vlm`), on the
prefetch thread while the step before trains. A group whose images break the wire's rules, or
do not decode, is dropped and counted (``filter/dropped_images``, ``filter/dropped_image_decode``),
never a crash.

Every row of a :class:`~learners.batching.TrainBatch` carries its own images (``pixel_values``
``[B, patches, C·T·P·P]`` and ``image_grid_thw`` ``[B, images, 3]``, zero-padded), so every
split of the batch into micro-batches or shares keeps a sample's images with its tokens. A
forward runs the vision tower on one row of each group present (the group's samples share
the prompt) and gives every row its group's features, in row order, which is the order of
their image tokens in the batch, with M-RoPE positions computed from the rows' grids
(:func:`forward_inputs`).

VLM batches run padded (``learner.packing = false``): Qwen2-VL's 3-D positions are computed
per row from the padded layout; a packed VLM micro-batch is refused naming the key. With
several ranks, each share's rows travel with their pixels and grids (``learners.balance``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from asyncrl.vlm import (ImageError, PromptImages, image_placeholders, instance_override,
                         placeholders_only, rope_positions, vision_inputs, vl_model)
from asyncrl.wire import TrajectoryGroup, WireError
from asyncrl.wire.images import IMAGE_SIZES, IMAGES, group_images

if TYPE_CHECKING:
    from learners.batching import TrainBatch

logger = logging.getLogger(__name__)

GroupVision = tuple[Tensor, Tensor] | None
"""One group's ``(pixel_values, image_grid_thw)``, or None for a prompt without images."""


@dataclass(frozen=True)
class LearnerVision(PromptImages):
    """What rank 0 needs to turn a VLM group's image bytes into pixels: the model's image
    processor and ids (``LearnerVision.of(model_dir)``: None for a text-only model)."""

    def prepare(self, groups: Sequence[TrajectoryGroup]
                ) -> tuple[list[TrajectoryGroup], list[GroupVision], Counter[str]]:
        """The groups whose images check and decode, each one's pixels and grid, and the
        dropped ones counted by reason (``images``, ``image_decode``)."""
        kept, inputs, dropped = [], [], Counter()
        for group in groups:
            try:
                images = group_images(group)
                inputs.append(self._checked(group, images) if images else None)
            except WireError as exc:
                dropped[exc.reason] += 1
                logger.warning("dropped group %s: %s", group.group_id, exc)
                continue
            except ImageError as exc:
                dropped["image_decode"] += 1
                logger.warning("dropped group %s: %s", group.group_id, exc)
                continue
            kept.append(group)
        return kept, inputs, dropped

    def _checked(self, group: TrajectoryGroup, images: list[bytes]) -> tuple[Tensor, Tensor]:
        """The images' pixels and grid; :class:`WireError` ``images`` when a sample holds
        fewer image tokens than its images fill (the forward would fail on it)."""
        pixels, grid = vision_inputs(self.processor, images)
        needed = int(grid.prod(-1).sum()) // self.spec.merge_size ** 2
        for sample in group.sample_slices():
            held = int((group.tokens[sample] == self.spec.image_token_id).sum())
            if held < needed:
                raise WireError("images", f"a sample holds {held} image tokens, its "
                                          f"{len(images)} image(s) fill {needed}")
        return pixels, grid

    def without_images(self, group: TrajectoryGroup, pad_id: int) -> TrajectoryGroup:
        """``group`` with its images gone and its image tokens padding: the zero-weight group
        a step runs when every group was dropped (it trains nothing)."""
        tokens = np.where(group.tokens == self.spec.image_token_id, pad_id, group.tokens)
        extras = {k: v for k, v in group.extras.items() if k not in (IMAGES, IMAGE_SIZES)}
        return dataclasses.replace(group, tokens=tokens.astype(group.tokens.dtype),
                                   extras=extras)


def collate_vision(groups: Sequence[TrajectoryGroup], vision: Sequence[GroupVision] | None
                   ) -> tuple[Tensor | None, Tensor | None]:
    """``(pixel_values [B, patches, dim], image_grid_thw [B, images, 3])``: each sample's
    group's images, zero-padded; ``(None, None)`` when no group has one."""
    if vision is None or all(v is None for v in vision):
        return None, None
    rows = [v for group, v in zip(groups, vision) for _ in range(group.size)]
    dim = next(v[0].shape[1] for v in rows if v is not None)
    patches = max((v[0].shape[0] for v in rows if v is not None), default=0)
    images = max((v[1].shape[0] for v in rows if v is not None), default=0)
    pixels = torch.zeros(len(rows), patches, dim, dtype=torch.float32)
    grids = torch.zeros(len(rows), images, 3, dtype=torch.int64)
    for row, value in enumerate(rows):
        if value is not None:
            pixels[row, :value[0].shape[0]] = value[0]
            grids[row, :value[1].shape[0]] = value[1]
    return pixels, grids


def forward_inputs(model: nn.Module, batch: TrainBatch
                   ) -> tuple[dict[str, Any], AbstractContextManager]:
    """The image inputs of one padded forward of ``batch`` and the context to run it in.

    The samples of a group share its prompt: the vision tower runs once a group (the context
    gives each row its group's features; their gradients add up as the rows' would) and
    ``get_rope_index``, a Python loop over rows, runs on one row a group. A row's positions
    are its group's up to its last image token and ``t + delta`` after it: the images are in
    the prompt, which the group's rows share at the same indices (right padding). The context
    also puts the features at a row's own image tokens only, when a row holds sampled ones
    (:func:`asyncrl.vlm.placeholders_only`)."""
    base = vl_model(model)
    input_ids, grid_rows = batch.input_ids, batch.image_grid_thw
    merge = base.config.vision_config.spatial_merge_size
    image_token = base.config.image_token_id
    counts = grid_rows.prod(-1)                               # [B, images] patches; 0: none
    if not bool((counts > 0).any()):   # rows of prompts without images alone
        return {}, nullcontext()
    placeholders = image_placeholders(input_ids, image_token, counts.sum(-1) // merge ** 2)
    groups, source = torch.unique(batch.group_index, return_inverse=True)
    first = torch.full((len(groups),), len(source), dtype=torch.long, device=source.device)
    first = first.scatter_reduce(0, source, torch.arange(len(source), device=source.device),
                                 "amin")                      # each group's first row
    shown = counts[first] > 0
    pixels = torch.cat([batch.pixel_values[row, :int(n)]
                        for row, n in zip(first.tolist(), counts[first].sum(-1).tolist())])
    positions, deltas = rope_positions(model, input_ids[first], batch.attention_mask[first],
                                       grid_rows[first][shown], placeholders[first])
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = torch.where(placeholders, index, -1).max(-1).values   # [B] last image token
    text = (index[None] + deltas[source]).expand(3, -1, -1)
    positions = torch.where((index[None] > last[:, None])[None], text, positions[:, source])
    context = ExitStack()
    context.enter_context(per_row_features(model, source.tolist(), shown.sum(-1).tolist()))
    if bool(((input_ids == image_token) & ~placeholders).any()):   # sampled image tokens
        context.enter_context(placeholders_only(model, placeholders))
    return ({"pixel_values": pixels, "image_grid_thw": grid_rows[first][shown],
             "position_ids": positions}, context)


@contextmanager
def per_row_features(model: nn.Module, source: list[int], images_per_group: list[int]
                     ) -> Iterator[None]:
    """Within: the model's image features, computed for each group's images once, are given
    to every row, row ``r`` those of group ``source[r]`` (``get_image_features`` replaced on
    the instance for the forward, which runs it inside the FSDP root's forward)."""
    base = vl_model(model)
    own = base.get_image_features

    def features(pixel_values: Tensor, image_grid_thw: Tensor | None = None, **kwargs: Any
                 ) -> Any:
        out = own(pixel_values, image_grid_thw, **kwargs)
        pooled, by_group, start = list(out.pooler_output), [], 0
        for count in images_per_group:
            by_group.append(pooled[start:start + count])
            start += count
        out.pooler_output = tuple(image for group in source for image in by_group[group])
        return out

    with instance_override(base, "get_image_features", features):
        yield


def check_vlm_learner(cfg: Any) -> None:
    """What the learner does not do with a VLM yet, refused naming the key: packed
    micro-batches."""
    refuse_packing(cfg.packing, torch.zeros(0))


def refuse_packing(packing: bool, pixel_values: Tensor | None) -> None:
    if packing and pixel_values is not None:
        raise ValueError("learner.packing = true: a vision-language model's batches run padded "
                         "(3-D M-RoPE positions per row); set learner.packing = false")


__all__ = ["GroupVision", "LearnerVision", "check_vlm_learner", "collate_vision", "forward_inputs",
           "refuse_packing"]
