"""vLLM's ``AsyncLLM`` (the default mode) serving the tiny Qwen2-VL. Its engine core runs in a
spawned process, where only the worker extension can set up vLLM's Qwen2-VL without
torchvision (:mod:`rollouters.engines.vllm_qwen2_vl`) and its own processes (the engine core
builds the multimodal processor too): this test is that they do (the core is spawned here,
``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as in a run, not in this process as the other engine
tests run it), and that an update of the tower reaches an image the engine has seen (its
encoder cache reset)."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.engines.test_vllm_vlm import (  # noqa: F401 - module fixtures
    BLUE,
    LOGPROB_TOLERANCE,
    RED,
    VISION_PARAM,
    hf_logprobs,
    hf_model,
    image_prompt,
    solid,
    vlm_dir,
)

logger = logging.getLogger(__name__)
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture(scope="module")
def async_engine(vllm_env: dict[str, str], vlm_dir: Path) -> Iterator[object]:  # noqa: F811
    from asyncrl.models import EOS_ID
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    start = time.perf_counter()
    saved = os.environ.get(MULTIPROCESSING)
    os.environ[MULTIPROCESSING] = "1"  # the engine core in a spawned process, as in a run
    try:
        engine = AsyncVLLMEngine(vlm_dir, VLLMOptions(eos_ids=(EOS_ID,), seed=0,
                                                      freeze_vision=False))
    finally:
        os.environ[MULTIPROCESSING] = saved or "0"
    logger.info("vLLM AsyncLLM VLM engine started in %.1fs", time.perf_counter() - start)
    try:
        yield engine
    finally:
        engine.close()


def test_async_engine_generates_from_images_and_takes_vision_weights(
        async_engine, hf_model, vlm_dir: Path) -> None:  # noqa: F811
    prompts = [image_prompt(vlm_dir, "1"), image_prompt(vlm_dir, "1234")]
    images = [[solid(RED)], [solid(BLUE)]]
    out = async_engine.generate(prompts, n=2, temperature=0.7, max_new_tokens=6, images=images)
    deltas = [abs(got - want)
              for prompt, image, group in zip(prompts, images, out) for c in group
              for got, want in zip(c.logprobs, hf_logprobs(hf_model, vlm_dir, prompt, image[0],
                                                           c.tokens, 0.7))]
    logger.info("AsyncLLM vs HF logprobs with images: max %.2e over %d tokens", max(deltas),
                len(deltas))
    assert len(deltas) >= 4 and max(deltas) < LOGPROB_TOLERANCE
    moved = copy.deepcopy(hf_model)  # a trained tower: one vision tensor moved
    vision = moved.state_dict()[VISION_PARAM[0]]
    vision.add_(1.0)
    async_engine.load_weights([(VISION_PARAM[0], vision)], version=1)
    np.testing.assert_allclose(async_engine.weight(VISION_PARAM[1]), vision)
    again = async_engine.generate(prompts[:1], n=2, temperature=0.7, max_new_tokens=3,
                                  images=images[:1])[0]   # the same image: not its old embedding
    after = [abs(got - want) for c in again
             for got, want in zip(c.logprobs, hf_logprobs(moved, vlm_dir, prompts[0],
                                                          images[0][0], c.tokens, 0.7))]
    assert max(after) < LOGPROB_TOLERANCE, after
