"""Vision-language models (Qwen2-VL family): what the engines, the learner and the tasks share.

One rule makes the loop exact: **a prompt's token ids are already expanded**. Each image in a
prompt is ``<|vision_start|>``, then ``grid_t·grid_h·grid_w / merge_size²`` image pad tokens
(:func:`image_token_count`), then ``<|vision_end|>``, as the HF processor writes them. The
engine generates from those ids and the images' encoded bytes; the learner recomputes the
pixels from the same bytes with the same image processor (:func:`vision_inputs`), so both run
the model on the same sequence. Images travel as PNG (or JPEG) bytes, never as pixels: a 28×28
PNG is ~100 bytes where its patches are 4.7 kB of float32.

Positions: Qwen2-VL rotates queries and keys by 3-D positions (time, height, width: M-RoPE).
:func:`rope_positions` computes them with the model's own ``get_rope_index`` from the ids, the
attention mask and the images' grids; every caller passes them explicitly, because the HF
model otherwise caches ``rope_deltas`` on itself between calls, which two interleaved
``generate`` calls (or a generate and a training forward) would share.

The tiny VLM (``model.tiny.vision.depth > 0``) is a random-init ``Qwen2VLForConditionalGeneration``
built in code: the char tokenizer plus :data:`IMAGE_TOKENS`, a vision tower of ``depth`` blocks,
and an image processor that resizes every image to ``image_size²`` pixels.

numpy and the standard library at import; torch, PIL and transformers inside functions.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from asyncrl.config.schema import TinyModelConfig

logger = logging.getLogger(__name__)

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = ("<|vision_start|>", "<|image_pad|>",
                                                  "<|vision_end|>", "<|video_pad|>")
IMAGE_TOKENS: tuple[str, ...] = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
"""The tokens the tiny VLM's char tokenizer adds (Qwen2-VL's names)."""
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""One image in a prompt's text before expansion (the processor's chat template writes it)."""
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
MAX_IMAGE_PIXELS = 4096 * 4096
"""Decoded images above this many pixels are refused (a decompression bomb costs nothing to
send and gigabytes to decode)."""


class ImageError(ValueError):
    """Image bytes that do not decode to an image the processor can take."""


@dataclass(frozen=True)
class VisionSpec:
    """The ids and sizes prompt expansion needs, read from a VLM's ``config.json``."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionSpec:
        return cls(int(config["image_token_id"]), int(config["vision_start_token_id"]),
                   int(config["vision_end_token_id"]),
                   int(config["vision_config"]["spatial_merge_size"]))


def vision_spec(model_dir: str | Path) -> VisionSpec | None:
    """The model's :class:`VisionSpec`, or None for a text-only model (or a hub id, whose
    ``config.json`` is not local)."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    if config.get("model_type") not in VISION_MODEL_TYPES:
        return None
    return VisionSpec.from_config(config)


def is_vlm(model: Any) -> bool:
    """Is this HF model (or config) one of :data:`VISION_MODEL_TYPES`?"""
    config = getattr(model, "config", model)
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


def auto_model_class(path: str | Path) -> Any:
    """The transformers auto class that loads ``path``: image-text-to-text for a VLM (which
    ``AutoModelForCausalLM`` does not map), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_spec(path) is not None else AutoModelForCausalLM


def vision_prefix(model: Any) -> str | None:
    """The qualified name of the model's vision tower (``model.visual`` in transformers 5),
    or None without one. Parameter names under it (``prefix + "."``) are the tower's."""
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual":
            return name
    return None


def is_vision_name(name: str) -> bool:
    """Is ``name`` a parameter of a Qwen2-VL vision tower (HF names, FSDP2's too)?"""
    return name.startswith(("model.visual.", "visual."))


def freeze_vision(model: Any) -> int:
    """Stop gradients to the vision tower (``model.freeze_vision``, as verl does); returns the
    parameters frozen (0 for a text-only model)."""
    prefix = vision_prefix(model)
    if prefix is None:
        return 0
    tower = model.get_submodule(prefix)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


# --- images ---------------------------------------------------------------------------------

def encode_png(pixels: Any) -> bytes:
    """``pixels`` (``[H, W, 3]`` uint8) as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def decode_images(images: Sequence[bytes]) -> list[Any]:
    """PIL RGB images from encoded bytes; :class:`ImageError` for bytes that are not an image
    PIL reads, or one over :data:`MAX_IMAGE_PIXELS`."""
    from PIL import Image, UnidentifiedImageError

    decoded = []
    for index, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(bytes(data))) as image:
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"image {index}: {image.width}x{image.height} pixels, "
                                     f"more than {MAX_IMAGE_PIXELS}")
                decoded.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            if isinstance(exc, ImageError):
                raise
            raise ImageError(f"image {index} does not decode: {exc}") from None
    return decoded


def build_image_processor(image_size: int, patch_size: int = 14, merge_size: int = 2,
                          temporal_patch_size: int = 2) -> Any:
    """Qwen2-VL's image processor (PIL backend: no torchvision) resizing every image to
    ``image_size²`` pixels (a multiple of ``patch_size · merge_size``), so each image is
    ``(image_size / patch_size)² / merge_size²`` tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    pixels = image_size * image_size
    return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=patch_size,
                                    merge_size=merge_size, temporal_patch_size=temporal_patch_size)


def load_image_processor(model_dir: str | Path) -> Any:
    """The image processor saved beside a VLM (``preprocessor_config.json``), with the PIL
    backend: the fast one needs torchvision, which the CPU install does not have."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))


def image_processor_for(model_dir: str | Path) -> Any:
    """The image processor of a VLM saved in ``model_dir``; None for a text-only model."""
    return load_image_processor(model_dir) if vision_spec(model_dir) is not None else None


def vision_inputs(processor: Any, images: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values [patches, C·T·P·P], image_grid_thw [images, 3])`` of encoded images, as
    the model's forward takes them; :class:`ImageError` for bytes that do not decode."""
    out = processor(images=decode_images(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """Image pad tokens of one image: ``t·h·w / merge_size²`` (the processor's rule)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def expand_image_tokens(ids: Sequence[int], counts: Sequence[int], image_token_id: int
                        ) -> list[int]:
    """``ids`` with the i-th image pad token repeated ``counts[i]`` times; ValueError when the
    prompt holds another number of image pads than images."""
    pads = sum(1 for token in ids if token == image_token_id)
    if pads != len(counts):
        raise ValueError(f"the prompt has {pads} image placeholders for {len(counts)} images")
    remaining = iter(counts)
    out: list[int] = []
    for token in ids:
        out += [token] * int(next(remaining)) if token == image_token_id else [token]
    return out


IMAGE_MARK = "<image>"
"""Where a data row's prompt puts an image (verl's and LLaVA's convention)."""


@dataclass(frozen=True)
class PromptImages:
    """What the HF processor does to a prompt with images, for one model: each
    :data:`IMAGE_MARK` becomes :data:`IMAGE_PLACEHOLDER` (none: one per image before the text),
    and after tokenizing each image pad is repeated by the image's token count."""

    processor: Any
    spec: VisionSpec

    @classmethod
    def of(cls, model_dir: str | Path) -> PromptImages | None:
        spec = vision_spec(model_dir)
        return None if spec is None else cls(load_image_processor(model_dir), spec)

    def mark(self, text: str, images: int, first: bool = True) -> str:
        """``text`` with its image marks as placeholders; ``first``: the text that gets the
        placeholders when no text of the prompt marks where they go."""
        if IMAGE_MARK in text:
            return text.replace(IMAGE_MARK, IMAGE_PLACEHOLDER)
        return IMAGE_PLACEHOLDER * images + text if first else text

    def expand(self, ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        """``ids`` with each image's pad repeated by its token count (its grid from the
        processor); :class:`ImageError` for bytes that do not decode."""
        _, grid = vision_inputs(self.processor, images)
        counts = [image_token_count(g, self.spec.merge_size) for g in grid.tolist()]
        return expand_image_tokens(ids, counts, self.spec.image_token_id)


def rope_positions(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor | None,
                   placeholders: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, B, T], deltas [B, 1])``: M-RoPE positions of a (left- or right-)
    padded batch, from the model's own ``get_rope_index``. A generated token at sequence index
    ``n`` (counting real tokens only) has position ``n + delta`` on all three axes.
    ``placeholders``: which tokens stand for the images (default: every image pad token;
    :func:`image_placeholders` says why a sequence may hold others)."""
    import torch

    base = vl_model(model)
    if placeholders is None:
        placeholders = input_ids == base.config.image_token_id
    if image_grid_thw is None or not bool(placeholders.any()):
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return (positions[None].expand(3, -1, -1),
                torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device))
    return base.get_rope_index(input_ids, placeholders.int(), image_grid_thw.to(input_ids.device),
                               attention_mask=attention_mask)


def image_placeholders(input_ids: torch.Tensor, image_token_id: int,
                       tokens_per_row: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the first ``tokens_per_row[b]`` image pad tokens of each row, those the
    row's images fill. A policy may sample the image pad token too (a random-init one does):
    the engine fed it back as an ordinary token, and so must the learner."""
    pads = input_ids == image_token_id
    return pads & (pads.cumsum(-1) <= tokens_per_row[:, None])


@contextmanager
def placeholders_only(model: Any, placeholders: torch.Tensor) -> Iterator[None]:
    """Within: the model puts image features at ``placeholders`` alone, not at every image pad
    token (its ``get_placeholder_mask``, replaced on the instance for the forward)."""
    base = vl_model(model)
    own = base.get_placeholder_mask

    def mask(input_ids: Any, inputs_embeds: Any, image_features: Any = None,
             video_features: Any = None) -> tuple[Any, Any]:
        _, video = own(input_ids, inputs_embeds=inputs_embeds, video_features=video_features)
        if image_features is not None and int(placeholders.sum()) * inputs_embeds.shape[-1] \
                != image_features.numel():
            raise ValueError(f"{int(placeholders.sum())} image placeholders for "
                             f"{image_features.shape[0]} image features")
        return placeholders.unsqueeze(-1).to(inputs_embeds.device), video

    with instance_override(base, "get_placeholder_mask", mask):
        yield


@contextmanager
def instance_override(module: Any, name: str, replacement: Any) -> Iterator[None]:
    """Within: ``module.<name>`` is ``replacement`` on this instance alone; the class's method
    again after (what the engine's and the learner's forwards patch for one call)."""
    setattr(module, name, replacement)
    try:
        yield
    finally:
        delattr(module, name)


def vl_model(model: Any) -> Any:
    """The module holding ``get_rope_index`` (``Qwen2VLModel``), under any wrapper."""
    for module in model.modules():
        if hasattr(module, "get_rope_index"):
            return module
    raise ValueError(f"{type(model).__name__} is not a Qwen2-VL model (no get_rope_index)")


# --- the tiny VLM -----------------------------------------------------------------------------

def build_tiny_vlm(cfg: TinyModelConfig, tokenizer: Any, seed: int) -> PreTrainedModel:
    """A random-init ``Qwen2VLForConditionalGeneration``: ``cfg``'s text model and a vision
    tower of ``cfg.vision`` (identical for identical arguments). ``tokenizer`` is the char
    tokenizer with :data:`IMAGE_TOKENS` among its extra tokens."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from asyncrl.models import BOS_ID, EOS_ID, PAD_ID

    vision = cfg.vision
    half = cfg.hidden_size // cfg.num_heads // 2   # M-RoPE splits each head's rotary pairs
    temporal = half // 4
    height = (half - temporal) // 2
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id",
                    "video_token_id"), tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))))
    text = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [temporal, height, half - temporal - height]},
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = Qwen2VLConfig(
        text_config=text, tie_word_embeddings=True, **ids,
        vision_config=dict(depth=vision.depth, embed_dim=vision.embed_dim,
                           hidden_size=cfg.hidden_size, num_heads=vision.num_heads,
                           mlp_ratio=vision.mlp_ratio, patch_size=vision.patch_size,
                           spatial_merge_size=vision.merge_size, temporal_patch_size=2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    for key, value in (("bos_token_id", BOS_ID), ("eos_token_id", EOS_ID),
                       ("pad_token_id", PAD_ID)):
        setattr(model.generation_config, key, value)
    return model.float().eval()


def tiny_image_processor(cfg: TinyModelConfig) -> Any:
    """The tiny VLM's image processor (saved beside it as ``preprocessor_config.json``)."""
    vision = cfg.vision
    return build_image_processor(vision.image_size, vision.patch_size, vision.merge_size)


__all__ = ["IMAGE_PLACEHOLDER", "IMAGE_TOKENS", "ImageError", "VisionSpec", "auto_model_class",
           "build_image_processor", "build_tiny_vlm", "decode_images", "encode_png",
           "expand_image_tokens", "freeze_vision", "image_placeholders", "image_processor_for",
           "image_token_count", "placeholders_only", "vl_model", "is_vision_name",
           "is_vlm", "load_image_processor", "rope_positions", "tiny_image_processor",
           "vision_inputs", "vision_prefix", "vision_spec"]
