"""The tiny mixture-of-experts model (``model.tiny.num_experts``): a Qwen3-MoE built in code
that FSDP2 shards expert by expert, so the loop runs on an MoE architecture in CI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, ModelConfig
from tests.unit.test_fsdp2 import make_groups, spawn_runs

MOE = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "extra_tokens": ["+", "-"]}  # 16 ids, as make_groups draws
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models import prepare_model_dir

    cfg = ModelConfig.model_validate({"tiny": MOE})
    return prepare_model_dir(cfg, tmp_path_factory.mktemp("moe"), seed=0)


def test_the_tiny_moe_routes_each_token_to_its_top_k_experts(moe_dir: Path) -> None:
    from asyncrl.models import load_causal_lm
    from learners.backends.fsdp2 import decoder_blocks

    model = load_causal_lm(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert decoder_blocks(model) == ["model.layers.0", "model.layers.1"]
    out = model(torch.tensor([[1, 4, 5, 6, 2]]), output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (5, 4)
    assert model.get_parameter(EXPERTS).shape[0] == 4


def test_more_experts_per_token_than_experts_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="model.tiny.num_experts_per_tok = 5 must not exceed"):
        ModelConfig.model_validate({"tiny": {**MOE, "num_experts_per_tok": 5}})


def _train_moe(rank: int, world: int, device: torch.device, model_dir: str,
               out_dir: str) -> None:
    """Two FSDP2 steps on the MoE; each rank records its shard of one expert tensor."""
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.batching import collate

    trainer = Fsdp2Trainer(model_dir, LearnerConfig(lr=1e-3), device)
    local = trainer.model.get_parameter(EXPERTS).to_local()
    batch = collate(make_groups(), std_norm=True, pad_id=0)
    metrics = [trainer.train_step(batch) for _ in range(2)]
    torch.save({"metrics": metrics, "local_experts": local.shape[0]},
               Path(out_dir) / f"rank{rank}.pt")


def test_fsdp2_shards_the_experts_across_ranks_and_trains(moe_dir: Path,
                                                          tmp_path: Path) -> None:
    out = spawn_runs(_train_moe, moe_dir, tmp_path, {"moe": (2, ())})["moe"]
    for rank in (0, 1):
        saved = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert saved["local_experts"] == 2     # 4 experts, dim 0 sharded over 2 ranks
        metrics = saved["metrics"]
        assert metrics[0]["actor/grad_norm"] > 0
        assert metrics[1]["actor/loss"] != metrics[0]["actor/loss"]
