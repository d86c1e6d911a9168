"""``learner.liger``: refused with the key named where it cannot run; on CUDA with
liger-kernel, the patched model gives the plain model's logprobs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from learners.liger import check_liger
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)

LIGER = importlib.util.find_spec("liger_kernel") is not None


@pytest.mark.skipif(LIGER, reason="liger-kernel is installed here")
def test_refused_without_liger_kernel() -> None:
    with pytest.raises(ValueError, match=r"learner.liger = true needs the liger-kernel"):
        check_liger(torch.device("cuda"))


@pytest.mark.usefixtures("one_rank_group")
def test_trainer_refuses_before_loading(tmp_path) -> None:
    """The trainer refuses at once (no model at this path is ever read)."""
    from asyncrl.config.schema import LearnerConfig
    from learners.backends.fsdp2 import Fsdp2Trainer

    with pytest.raises(ValueError, match=r"learner.liger = true needs"):
        Fsdp2Trainer(tmp_path / "absent", LearnerConfig(liger=True), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (LIGER and torch.cuda.is_available()), reason="needs CUDA and liger")
def test_liger_model_gives_plain_logprobs() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learners.batching import collate
    from learners.liger import apply_liger
    from learners.packing import token_logprobs
    from tests.unit.test_packing import VOCAB, make_groups

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    plain = Qwen2ForCausalLM(config).eval().cuda()
    patched = Qwen2ForCausalLM(config).eval().cuda()
    patched.load_state_dict(plain.state_dict())
    apply_liger(patched)
    batch = collate(make_groups([[9, 4, 12], [3, 7]]), std_norm=True, pad_id=0).to("cuda")
    real = batch.attention_mask.bool()
    with torch.no_grad():
        want, got = token_logprobs(plain, batch), token_logprobs(patched, batch)
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
