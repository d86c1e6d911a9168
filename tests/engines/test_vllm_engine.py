"""The in-process vLLM engine against the learner's own arithmetic.

One engine is shared by the session (see conftest); tests that load weights put the initial
ones back before they return, so order does not matter.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import TaskConfig
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
from rollouters.engines.base import Completion
from rollouters.tasks import make_task
from tests.engines.vllm_sleep_checks import (
    check_a_sleep_without_an_update_wakes_with_the_same_weights,
    check_update_while_asleep_lands_at_the_wake,
)

logger = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 1e-4  # mean |engine - learner| per token, fp32 (measured ~1e-6)
PROMPTS = [[1, 5, 6, 7, 8, 2], [1, 13, 4, 9, 2], [1, 7, 7, 2]]


@pytest.fixture
def engine(vllm_engine, reference_state: dict) -> Iterator[object]:
    """The shared engine; whatever a test loads, the initial weights are back afterwards."""
    yield vllm_engine
    vllm_engine.on_step = None
    if vllm_engine.version != 0:
        vllm_engine.load_weights(reference_state.items(), version=0)


def _patched(state: dict) -> dict:
    """The initial weights with the final norm negated: every logit flips sign, so greedy
    decoding picks the least likely token. Deterministic, and far from the original policy."""
    patched = dict(state)
    patched["model.norm.weight"] = -state["model.norm.weight"]
    return patched


def _reference_engine(model_dir: Path, state: dict):
    from rollouters.engines.torch_engine import TorchEngine

    model = load_causal_lm(model_dir)
    model.load_state_dict(state)
    return TorchEngine(model, eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0)


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


def test_logprobs_match_learner_recompute(engine, tiny_model_dir: Path) -> None:
    """Behaviour logprobs at T=1 equal the learner's ``token_logprobs`` on the collated batch."""
    from learners.backends.fsdp2 import token_logprobs
    from learners.batching import collate
    from rollouters.workflows.single_turn import generate_groups

    task = make_task(TaskConfig(), seed=0)
    start = time.perf_counter()
    groups = generate_groups(engine, task, task.sample(random.Random(0), 8), group_size=16,
                             temperature=1.0, max_new_tokens=8)
    elapsed = time.perf_counter() - start
    tokens = sum(g.num_generated for g in groups)
    logger.info("vLLM: %d tokens in %.2fs (%.0f tokens/s)", tokens, elapsed, tokens / elapsed)
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    with torch.no_grad():
        learner = token_logprobs(load_causal_lm(tiny_model_dir), batch)
    delta = (learner - batch.behaviour_logprobs)[batch.loss_mask].abs()
    logger.info("logprob mismatch: mean %.2e max %.2e over %d tokens", delta.mean(), delta.max(),
                delta.numel())
    assert delta.numel() == tokens
    assert float(delta.mean()) < LOGPROB_TOLERANCE
    assert bool((batch.versions[batch.loss_mask] == 0).all())


def test_logprobs_are_after_temperature(engine, tiny_model_dir: Path) -> None:
    """At T=0.6 the engine reports log_softmax(logits / T) of the sampled token."""
    model = load_causal_lm(tiny_model_dir)
    completions = _flat(engine.generate(PROMPTS, n=4, temperature=0.6, max_new_tokens=6))
    deltas = []
    for prompt, completion in zip([p for p in PROMPTS for _ in range(4)], completions):
        ids = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits / 0.6, dim=-1)
        expected = logp.gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        deltas.append((expected - torch.tensor(completion.logprobs)).abs())
    assert float(torch.cat(deltas).mean()) < LOGPROB_TOLERANCE


def test_update_changes_outputs_as_weights_dictate(engine, tiny_model_dir: Path,
                                                   reference_state: dict) -> None:
    before = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    patched = _patched(reference_state)
    engine.load_weights(patched.items(), version=1)
    assert engine.version == 1
    after = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    expected = _flat(_reference_engine(tiny_model_dir, patched).generate(
        PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    assert [c.tokens for c in after] == [c.tokens for c in expected]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert all(set(c.versions) == {1} for c in after)
    engine.load_weights(reference_state.items(), version=2)
    again = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]


def test_in_flight_update_tags_each_token(engine, tiny_model_dir: Path,
                                          reference_state: dict) -> None:
    """An update after step 2 of a running batch: tokens 0-2 are version 0, the rest version 1,
    and the tokens are those the torch reference makes with the same switch (the patch leaves
    the KV cache as it was, so recomputing it under the new weights changes nothing)."""
    patched = _patched(reference_state)
    reference = _reference_engine(tiny_model_dir, reference_state)
    for target in (engine, reference):
        target.on_step = _switch_at(target, 2, patched)
    got = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    want = _flat(reference.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8,
                                    greedy=True))
    assert engine.version == 1
    for completion, expected in zip(got, want):
        assert len(completion.tokens) > 3, completion
        assert completion.versions == [0, 0, 0] + [1] * (len(completion.tokens) - 3)
        assert completion.tokens == expected.tokens
        assert completion.versions == expected.versions
        delta = torch.tensor(completion.logprobs) - torch.tensor(expected.logprobs)
        assert float(delta.abs().max()) < 1e-3


def _switch_at(target, step: int, state: dict):
    def on_step(current: int) -> None:
        if current == step:
            target.load_weights(state.items(), version=1)
    return on_step


def test_updates_from_another_thread_keep_versions_monotonic(engine,
                                                             reference_state: dict) -> None:
    """The receiver thread loads weights while ``generate`` runs: every row's versions never go
    back, and each is a version that was loaded."""
    stop, loaded = threading.Event(), [0]

    def receiver() -> None:
        while not stop.is_set() and loaded[-1] < 50:
            engine.load_weights(reference_state.items(), version=loaded[-1] + 1)
            loaded.append(loaded[-1] + 1)

    thread = threading.Thread(target=receiver, name="test-receiver")
    thread.start()
    try:
        completions = _flat(engine.generate(PROMPTS * 4, n=8, temperature=1.0,
                                            max_new_tokens=8))
    finally:
        stop.set()
        thread.join()
    for completion in completions:
        assert completion.versions == sorted(completion.versions)
        assert set(completion.versions) <= set(loaded)
        assert len(completion.versions) == len(completion.tokens) == len(completion.logprobs)


def test_a_failed_update_is_followed_by_a_fresh_join(engine, tiny_model_dir: Path,
                                                     reference_state: dict) -> None:
    """An update with a name the model lacks is refused before anything is sent
    (``check_fit``): the transfer group stays. Behind that check (widened here, as for a
    server whose model is not the worker's directory), the worker refuses it at its first
    tensor: that raises at once, not after the broadcast's timeout, and drops the transfer
    group; the next update joins a fresh group and lands, as after an eviction and rejoin.
    Meanwhile the engine generates with the weights it had."""
    from asyncrl.weights.fit import WeightsRefused

    before = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    engine.load_weights(reference_state.items(), version=0)  # joined, whatever ran before
    group = engine._sender.group
    bad = {"model.no_such_layer.weight": torch.zeros(2), **reference_state}
    with pytest.raises(WeightsRefused, match="no_such_layer"):
        engine.load_weights(bad.items(), version=1)
    assert engine._sender.group is group and engine.version == 0

    shapes = engine._shapes
    engine._shapes = {**shapes, "model.no_such_layer.weight": (2,)}
    start = time.perf_counter()
    try:
        with pytest.raises(Exception, match="no_such_layer"):
            engine.load_weights(bad.items(), version=1)
    finally:
        engine._shapes = shapes
    assert time.perf_counter() - start < 30  # not the 60 s gloo timeout
    assert engine._sender.group is None and engine.version == 0
    again = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]
    patched = _patched(reference_state)
    engine.load_weights(patched.items(), version=2)
    assert engine.version == 2
    after = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    expected = _flat(_reference_engine(tiny_model_dir, patched).generate(
        PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    assert [c.tokens for c in after] == [c.tokens for c in expected]
    assert all(set(c.versions) == {2} for c in after)


def test_update_while_asleep_lands_at_the_wake(engine, tiny_model_dir: Path,
                                               reference_state: dict) -> None:
    """``launcher.colocate``: sleep, a call that waits, an update held, the wake
    (``vllm_sleep_checks``, also run on the async engine)."""
    check_update_while_asleep_lands_at_the_wake(engine, tiny_model_dir, reference_state)


def test_a_sleep_without_an_update_keeps_the_weights(engine) -> None:
    check_a_sleep_without_an_update_wakes_with_the_same_weights(engine)
