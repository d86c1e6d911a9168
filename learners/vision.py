"""The learner's side of vision-language models: image bytes → per-row pixels → the forward.

Rank 0 recomputes each group's pixels from its images' bytes (``asyncrl.wire.images``) with the
image processor saved beside the model, the one the engines use (:mod:`asyncrl.vlm`), on the
prefetch thread while the step before trains. A group whose images break the wire's rules, or
do not decode, is dropped and counted (``filter/dropped_images``, ``filter/dropped_image_decode``),
never a crash.

Every row of a :class:`~learners.batching.TrainBatch` carries its own images (``pixel_values``
``[B, patches, C·T·P·P]`` and ``image_grid_thw`` ``[B, images, 3]``, zero-padded), so every
split of the batch into micro-batches or shares keeps a sample's images with its tokens. The
forward concatenates the rows' real patches in row order, which is the order of their image
tokens in the batch, and passes M-RoPE positions computed from the rows' grids.

VLM batches run padded (``learner.packing = false``): Qwen2-VL's 3-D positions are computed
per row from the padded layout; a packed VLM micro-batch is refused naming the key. With
several ranks, each share's rows travel with their pixels and grids (``learners.balance``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from asyncrl.vlm import (ImageError, PromptImages, image_placeholders, rope_positions,
                         vision_inputs, vl_model)
from asyncrl.wire import TrajectoryGroup, WireError
from asyncrl.wire.images import IMAGE_SIZES, IMAGES, group_images

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
                inputs.append(vision_inputs(self.processor, images) if images else None)
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


def forward_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   pixel_values: Tensor, image_grid_thw: Tensor
                   ) -> tuple[dict[str, Tensor], Tensor | None]:
    """The image inputs of one padded forward (the rows' real patches and grids in row order,
    the rows' M-RoPE positions) and, when a row holds image pad tokens beyond its images'
    (sampled ones), the placeholder mask to run the forward under
    (:func:`asyncrl.vlm.placeholders_only`); else None."""
    base = vl_model(model)
    counts = image_grid_thw.prod(-1)                 # [B, images] patches; 0 on padding
    grid = image_grid_thw[counts > 0]
    pixels = torch.cat([pixel_values[row, :int(n)] for row, n in enumerate(counts.sum(-1))])
    merge = base.config.vision_config.spatial_merge_size
    image_token = base.config.image_token_id
    placeholders = image_placeholders(input_ids, image_token, counts.sum(-1) // merge ** 2)
    positions, _ = rope_positions(model, input_ids, attention_mask, grid, placeholders)
    sampled = bool(((input_ids == image_token) & ~placeholders).any())
    return ({"pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions},
            placeholders if sampled else None)


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
