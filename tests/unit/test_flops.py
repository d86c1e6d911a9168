"""``perf/mfu``: the model FLOPs of a step (``learners.flops``), counted from real models, and
the learner's step reporting them against the device's peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.schema import LearnerConfig, ModelConfig
from learners.batching import collate
from learners.flops import ModelFlops, mfu, peak_flops, peak_for_name
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import make_groups, tiny_model_dir  # noqa: F401 (fixture)
from tests.unit.test_moe import MOE
from tests.unit.test_vlm import TINY_VLM


def _qwen2(tie: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tie", [True, False])
def test_a_dense_model_counts_its_layers_head_and_attention(tie: bool) -> None:
    model = _qwen2(tie)
    total = sum(p.numel() for p in model.parameters())   # a tied weight once
    counts = ModelFlops.of(model)
    assert counts.head == 50 * 32
    # Neither the input embedding (a lookup) nor the head is in the dense count.
    assert counts.dense == total - 50 * 32 * (1 if tie else 2)
    assert counts.attention == 3 * 4 * 8   # layers · heads · head_dim
    lengths, trained = [5, 3], 4
    forward = 2 * counts.dense * 8 + 2 * counts.head * trained + 2 * 96 * (25 + 9)
    assert counts.forward(lengths, trained) == forward
    assert counts.step(lengths, trained) == 3 * forward
    assert counts.step(lengths, trained, frozen_forwards=2) == 5 * forward


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to(tmp_path: Path) -> None:
    from asyncrl.models import load_causal_lm, prepare_model_dir

    model = load_causal_lm(prepare_model_dir(ModelConfig.model_validate({"tiny": MOE}),
                                             tmp_path, seed=0))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert experts > 0
    counts = ModelFlops.of(model)
    head_and_embed = counts.head * (1 if model.config.tie_word_embeddings else 2)
    share = MOE["num_experts_per_tok"] / MOE["num_experts"]
    assert counts.dense == pytest.approx(others - head_and_embed + share * experts)


def test_a_vision_tower_is_not_counted(tmp_path: Path) -> None:
    from asyncrl.models import prepare_model_dir
    from asyncrl.vlm import auto_model_class, vision_prefix

    path = prepare_model_dir(ModelConfig.model_validate({"tiny": TINY_VLM}), tmp_path, seed=0)
    model = auto_model_class(path).from_pretrained(path)
    tower = vision_prefix(model)
    assert tower is not None
    in_tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(tower + "."))
    text = sum(p.numel() for n, p in model.named_parameters()
               if not n.startswith(tower + "."))
    counts = ModelFlops.of(model)
    head_and_embed = counts.head * (1 if model.config.get_text_config().tie_word_embeddings
                                    else 2)
    assert in_tower > 0 and counts.dense == text - head_and_embed


def test_peaks_by_name_and_by_key() -> None:
    assert peak_for_name("NVIDIA H200") == 989e12   # not the H20's, whose name it contains
    assert peak_for_name("NVIDIA H20") == 148e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_for_name("Some Future GPU") is None
    cpu = torch.device("cpu")
    assert peak_flops(cpu) is None                     # no MFU on a CPU ...
    assert peak_flops(cpu, override_tflops=2.0) == 2e12   # ... unless learner.peak_tflops
    assert mfu(6e12, 2.0, 1e12, world=2) == 1.5
    assert mfu(6e12, 2.0, None, world=2) is None


@pytest.mark.usefixtures("one_rank_group")
def test_the_step_reports_its_flops_and_mfu(tiny_model_dir: Path) -> None:
    """perf/tflops is the step's model FLOPs (the fused head on trained tokens alone) per
    second of timing/train_step; perf/mfu appears with a peak, against it."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    batch = collate(make_groups(), std_norm=True, pad_id=0)
    cfg = LearnerConfig(lr=1e-3, micro_batch_tokens=40, packing=True)
    plain = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    metrics = plain.train_step(batch)
    assert "perf/mfu" not in metrics   # a CPU has no known peak
    counts = ModelFlops.of(plain.model)
    flops = counts.step(batch.lengths.tolist(), int((batch.loss_mask != 0).sum()))
    assert metrics["perf/tflops"] == pytest.approx(
        flops / metrics["timing/train_step"] / 1e12, rel=1e-9)
    peaked = Fsdp2Trainer(tiny_model_dir, cfg.model_copy(update={"peak_tflops": 0.5}), "cpu")
    metrics = peaked.train_step(batch)
    assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tflops"] / 0.5, rel=1e-9)
