"""How a prompt with images reaches vLLM, and which weights a vLLM update sends: pure
functions of :mod:`rollouters.engines.vllm_options` (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.vlm import VisionSpec, encode_png, expand_image_tokens
from rollouters.engines.vllm_options import (
    VLLMOptions,
    collapse_image_tokens,
    moves_vision,
    sent_weights,
    vllm_prompt,
)

SPEC = VisionSpec(image_token_id=7, vision_start_id=6, vision_end_id=8, merge_size=2)


def test_collapsing_undoes_the_expansion_and_leaves_stray_pads() -> None:
    one_pad_each = [1, 6, 7, 8, 4, 6, 7, 8, 2]
    expanded = expand_image_tokens(one_pad_each, [4, 9], SPEC.image_token_id)
    assert collapse_image_tokens(expanded, SPEC) == one_pad_each
    stray = [1, 6, 7, 7, 8, 7, 7, 2]   # pads a policy sampled, outside an image
    assert collapse_image_tokens(stray, SPEC) == [1, 6, 7, 8, 7, 7, 2]


def test_a_prompt_reaches_vllm_collapsed_with_its_decoded_images() -> None:
    png = encode_png(np.zeros((28, 28, 3), dtype=np.uint8))
    assert vllm_prompt([1, 4, 2], None, None) == {"prompt_token_ids": [1, 4, 2]}
    assert vllm_prompt([1, 4, 2], [], SPEC) == {"prompt_token_ids": [1, 4, 2]}
    sent = vllm_prompt([1, 6, 7, 7, 7, 7, 8, 2], [png], SPEC)
    assert sent["prompt_token_ids"] == [1, 6, 7, 8, 2]
    assert [image.size for image in sent["multi_modal_data"]["image"]] == [(28, 28)]
    with pytest.raises(ValueError, match="text-only model"):
        vllm_prompt([1, 6, 7, 8, 2], [png], None)


def test_a_frozen_vision_tower_is_not_sent() -> None:
    tensors = [("model.visual.blocks.0.mlp.fc1.weight", 1),
               ("model.language_model.norm.weight", 2), ("lm_head.weight", 3)]
    frozen = VLLMOptions(eos_ids=(3,))
    assert frozen.freeze_vision
    assert [n for n, _ in sent_weights(tensors, frozen)] == [
        "model.language_model.norm.weight", "lm_head.weight"]
    assert sent_weights(tensors, VLLMOptions(eos_ids=(3,), freeze_vision=False)) == tensors
    assert moves_vision(tensors) and not moves_vision(sent_weights(tensors, frozen))
