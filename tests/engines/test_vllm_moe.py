"""vLLM generates with the tiny mixture-of-experts model (``model.tiny.num_experts``), and its
behaviour logprobs are the learner's: the same Qwen3-MoE directory the MoE quickstart trains."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import ModelConfig, TaskConfig, TinyModelConfig
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm, prepare_model_dir
from rollouters.tasks import make_task
from tests.engines.conftest import TINY_SETS
from tests.engines.test_vllm_engine import LOGPROB_TOLERANCE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = TinyModelConfig(**TINY_SETS, num_experts=4, num_experts_per_tok=2)
    return prepare_model_dir(ModelConfig(tiny=tiny), tmp_path_factory.mktemp("moe"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(vllm_env: dict[str, str], moe_dir: Path) -> Iterator[object]:
    from rollouters.engines.vllm_engine import VLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    engine = VLLMEngine(moe_dir, VLLMOptions(eos_ids=(EOS_ID,), seed=0))
    try:
        yield engine
    finally:
        engine.close()


def test_vllm_generates_with_the_moe_and_matches_the_learner(moe_engine, moe_dir: Path) -> None:
    from learners.backends.fsdp2 import token_logprobs
    from learners.batching import collate
    from rollouters.workflows.single_turn import generate_groups

    assert load_causal_lm(moe_dir).config.model_type == "qwen3_moe"
    task = make_task(TaskConfig(), seed=0)
    groups = generate_groups(moe_engine, task, task.sample(random.Random(3), 4), group_size=4,
                             temperature=1.0, max_new_tokens=8)
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    assert int(batch.loss_mask.sum()) >= 16
    with torch.no_grad():
        learner = token_logprobs(load_causal_lm(moe_dir), batch)
    delta = (learner - batch.behaviour_logprobs)[batch.loss_mask].abs()
    assert float(delta.mean()) < LOGPROB_TOLERANCE
