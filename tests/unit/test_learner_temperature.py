"""The learner's logprobs are of the distribution the engines sampled from: the logits divided
by ``rollout.temperature``, as the engines' behaviour logprobs are. Before, the learner used
the raw logits whatever the temperature, so at T != 1 every ratio against the behaviour was
off by the temperature (and the mismatch metrics said so)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.config.schema import TaskConfig, TinyModelConfig
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model
from learners.batching import collate
from learners.packing import token_logprobs, token_logprobs_and_entropy
from rollouters.engines.torch_engine import TorchEngine
from rollouters.tasks import make_task
from rollouters.workflows.single_turn import generate_groups

T = 0.7


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), len(VOCAB), seed=0)
    engine = TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0)
    task = make_task(TaskConfig(), seed=0)
    groups = generate_groups(engine, task, task.sample(random.Random(1), 4), group_size=4,
                             temperature=T, max_new_tokens=8)
    return model, collate(groups, std_norm=True, pad_id=PAD_ID)


@pytest.mark.parametrize("chunk_tokens", [0, 16])   # the plain path and the chunked one
@pytest.mark.parametrize("packing", [False, True])
def test_logprobs_at_the_rollout_temperature_are_the_behaviours(sampled, chunk_tokens: int,
                                                                 packing: bool) -> None:
    model, batch = sampled
    mask = batch.loss_mask
    with torch.no_grad():
        at_t = token_logprobs(model, batch, packing, chunk_tokens, temperature=T)
        raw = token_logprobs(model, batch, packing, chunk_tokens)
    assert float((at_t - batch.behaviour_logprobs)[mask].abs().mean()) < 1e-5
    assert float((raw - batch.behaviour_logprobs)[mask].abs().mean()) > 1e-2


def test_chunked_and_plain_agree_with_gradients_at_a_temperature(sampled) -> None:
    model, batch = sampled
    grads = []
    for chunk_tokens in (0, 16):
        model.zero_grad()
        logprobs, entropy = token_logprobs_and_entropy(
            model, batch, entropy_grad=True, chunk_tokens=chunk_tokens, temperature=T)
        (logprobs[batch.loss_mask].sum() + entropy[batch.loss_mask].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4)
