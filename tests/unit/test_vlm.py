"""The tiny vision-language model (``model.tiny.vision``) and the processor path of
:mod:`asyncrl.vlm`: image bytes → pixels and grids → expanded prompt ids → the model's forward,
and the torch engine generating from images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl import vlm
from asyncrl.config.schema import ModelConfig

TINY_VLM = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
            "vision": {"depth": 1, "embed_dim": 32, "num_heads": 2, "image_size": 28}}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models import prepare_model_dir

    cfg = ModelConfig.model_validate({"tiny": TINY_VLM})
    return prepare_model_dir(cfg, tmp_path_factory.mktemp("vlm"), seed=0)


def solid(rgb: tuple[int, int, int], size: int = 28) -> bytes:
    return vlm.encode_png(np.full((size, size, 3), rgb, dtype=np.uint8))


def image_prompt(model_dir: Path, images: int = 1, text: str = "12") -> list[int]:
    """``<bos>`` + one placeholder per image + ``text`` + ``<sep>``, expanded for 28² images."""
    from asyncrl.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    spec = vlm.vision_spec(model_dir)
    ids = tokenizer.encode("<bos>" + vlm.IMAGE_PLACEHOLDER * images + text + "<sep>")
    return vlm.expand_image_tokens(ids, [1] * images, spec.image_token_id)


def test_the_tiny_vlm_is_a_qwen2_vl_with_its_processor_beside_it(vlm_dir: Path) -> None:
    from asyncrl.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(vlm_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert vlm.vision_prefix(model) == "model.visual"
    spec = vlm.vision_spec(vlm_dir)
    tokenizer = load_tokenizer(vlm_dir)
    assert tokenizer.convert_tokens_to_ids(list(vlm.IMAGE_TOKENS[:3])) == \
        [spec.vision_start_id, spec.image_token_id, spec.vision_end_id]
    processor = vlm.load_image_processor(vlm_dir)
    pixels, grid = vlm.vision_inputs(processor, [solid((255, 0, 0)), solid((0, 0, 255), 40)])
    assert grid.tolist() == [[1, 2, 2], [1, 2, 2]]   # every image resized to 28²: one token
    assert pixels.shape == (8, 3 * 2 * 14 * 14)
    assert [vlm.image_token_count(g, spec.merge_size) for g in grid] == [1, 1]


def test_the_expanded_prompt_is_what_the_model_takes(vlm_dir: Path) -> None:
    """The model's own check (image pad tokens × width == image features) passes on the
    expanded ids and fails on a prompt with one pad too many: the expansion is the model's."""
    from asyncrl.models import load_causal_lm

    model = load_causal_lm(vlm_dir)
    processor = vlm.load_image_processor(vlm_dir)
    pixels, grid = vlm.vision_inputs(processor, [solid((0, 255, 0))])
    ids = torch.tensor([image_prompt(vlm_dir)])
    mask = torch.ones_like(ids)
    positions, _ = vlm.rope_positions(model, ids, mask, grid)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, pixel_values=pixels,
                image_grid_thw=grid)
    assert out.logits.shape[:2] == ids.shape
    spec = vlm.vision_spec(vlm_dir)
    doubled = torch.cat([ids[:, :3], ids[:, 2:]], dim=1)   # the image pad twice
    with pytest.raises(Exception, match="Image features and image tokens do not match"):
        model(input_ids=doubled, pixel_values=pixels, image_grid_thw=grid,
              position_ids=vlm.rope_positions(model, doubled, torch.ones_like(doubled),
                                              torch.tensor([[1, 2, 4]]))[0])
    assert int((doubled == spec.image_token_id).sum()) == 2


def test_expansion_repeats_each_pad_by_its_count_and_refuses_a_wrong_count() -> None:
    assert vlm.expand_image_tokens([1, 7, 9, 7, 2], [2, 3], image_token_id=7) == \
        [1, 7, 7, 9, 7, 7, 7, 2]
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        vlm.expand_image_tokens([1, 7, 2], [1, 1], image_token_id=7)


def test_bytes_that_are_not_an_image_are_an_image_error() -> None:
    good = solid((1, 2, 3))
    assert vlm.decode_images([good])[0].size == (28, 28)
    for bad in (b"", b"not a png", good[:40]):
        with pytest.raises(vlm.ImageError, match="image 1"):
            vlm.decode_images([good, bad])


def test_left_padding_does_not_move_the_positions(vlm_dir: Path) -> None:
    """M-RoPE positions of a left-padded row equal the unpadded row's, and a generated token
    continues at ``real tokens + delta``."""
    from asyncrl.models import load_causal_lm

    model = load_causal_lm(vlm_dir)
    grid = torch.tensor([[1, 2, 4]])   # two image tokens in a row: positions jump by 2, not 1
    row = image_prompt(vlm_dir, text="")
    row = row[:2] + row[2:3] * 2 + row[3:]
    alone, delta = vlm.rope_positions(model, torch.tensor([row]), torch.ones(1, len(row),
                                                                              dtype=torch.long),
                                      grid)
    padded = torch.tensor([[0, 0] + row])
    mask = torch.tensor([[0, 0] + [1] * len(row)])
    shifted, delta2 = vlm.rope_positions(model, padded, mask, grid)
    assert torch.equal(shifted[:, :, 2:], alone) and torch.equal(delta, delta2)
    assert int(alone.max()) + 1 == len(row) + int(delta)


def test_a_vision_tower_with_experts_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="model.tiny.vision.depth > 0 builds a Qwen2-VL"):
        ModelConfig.model_validate({"tiny": {**TINY_VLM, "num_experts": 4}})
    with pytest.raises(ValueError, match="model.tiny.vision.image_size = 30 must be a multiple"):
        ModelConfig.model_validate({"tiny": {**TINY_VLM, "vision": {"depth": 1,
                                                                     "image_size": 30}}})


def test_the_torch_engine_generates_from_images_and_its_logprobs_are_the_models(
        vlm_dir: Path) -> None:
    """Two prompts of different lengths (left padding), one image each, sampled at T = 0.7:
    each behaviour logprob equals the one a full forward of prompt + completion gives."""
    from asyncrl.models import load_causal_lm
    from rollouters.engines.torch_engine import TorchEngine

    model = load_causal_lm(vlm_dir)
    processor = vlm.load_image_processor(vlm_dir)
    engine = TorchEngine(model, eos_ids=[3], pad_id=0, seed=0, image_processor=processor)
    prompts = [image_prompt(vlm_dir, text="1"), image_prompt(vlm_dir, text="1234")]
    images = [[solid((255, 0, 0))], [solid((0, 0, 255))]]
    out = engine.generate(prompts, n=2, temperature=0.7, max_new_tokens=4, images=images)
    for prompt, image, group in zip(prompts, images, out):
        pixels, grid = vlm.vision_inputs(processor, image)
        for completion in group:
            ids = torch.tensor([prompt + completion.tokens])
            mask = torch.ones_like(ids)
            positions, _ = vlm.rope_positions(model, ids, mask, grid)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                               pixel_values=pixels, image_grid_thw=grid).logits[0]
            logp = torch.log_softmax(logits.float() / 0.7, -1)
            want = [float(logp[len(prompt) - 1 + i, t]) for i, t in
                    enumerate(completion.tokens)]
            np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)
    with pytest.raises(ValueError, match="1 image lists for 2 prompts"):
        engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=2, images=images[:1])


def test_a_prompt_of_two_images_of_several_tokens_generates_as_the_model_reads_it(
        tmp_path: Path) -> None:
    """56² images (4 tokens, 16 patches each), two in one prompt, n = 2 rows a prompt: the
    rows' pixels and positions, computed once a prompt, are each row's own."""
    from asyncrl.models import load_causal_lm, load_tokenizer, prepare_model_dir
    from rollouters.engines.torch_engine import TorchEngine

    tiny = {**TINY_VLM, "vision": {**TINY_VLM["vision"], "image_size": 56}}
    model_dir = prepare_model_dir(ModelConfig.model_validate({"tiny": tiny}), tmp_path, seed=1)
    model, processor = load_causal_lm(model_dir), vlm.load_image_processor(model_dir)
    spec, tokenizer = vlm.vision_spec(model_dir), load_tokenizer(model_dir)
    text = "<bos>" + vlm.IMAGE_PLACEHOLDER + "1" + vlm.IMAGE_PLACEHOLDER + "<sep>"
    prompts = [vlm.expand_image_tokens(tokenizer.encode(text), [4, 4], spec.image_token_id),
               tokenizer.encode("<bos>12<sep>")]
    rng = np.random.default_rng(0)
    images = [[vlm.encode_png(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
               for _ in range(2)], []]
    engine = TorchEngine(model, eos_ids=[3], pad_id=0, seed=0, image_processor=processor)
    out = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=3, images=images)
    pixels, grid = vlm.vision_inputs(processor, images[0])
    for completion in out[0]:
        ids = torch.tensor([prompts[0] + completion.tokens])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                           image_grid_thw=grid,
                           position_ids=vlm.rope_positions(model, ids, mask, grid)[0]).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        want = [float(logp[len(prompts[0]) - 1 + i, t]) for i, t in enumerate(completion.tokens)]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)


def test_what_the_vlm_path_does_not_do_is_refused_naming_the_keys() -> None:
    from asyncrl.config.errors import ConfigError
    from asyncrl.config.load import load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "vlm_quickstart.toml"
    assert load_config(config).task.name == "colour"
    for overrides, message in (
            (["model.tiny.vision.depth=0"], 'task.name = "colour" needs the tiny vision-'),
            (["learner.backend=deepspeed"], 'needs learner.backend = "fsdp2", not "deepspeed"'),
            (["learner.loss.advantage=gae"], 'learner.loss.advantage = "gae" is not supported'),
            (["rollout.engine=sglang"], 'rollout.engine = "sglang" does not take images yet')):
        with pytest.raises(ConfigError, match=message):
            load_config(config, overrides)
    assert load_config(config, ["rollout.engine=vllm"]).rollout.engine == "vllm"  # takes them
