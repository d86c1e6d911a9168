"""vLLM's ``AsyncLLM`` engine (``rollout.vllm.mode = "async"``): engine core in its own process
(spawned here too, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, where the other engine tests keep it in
the test's process), weights through vLLM's weight-transfer API with ``weights.transport = "ipc"``: on CPU that is
``asyncrl_shm``, vLLM's own ``ipc`` worker half mapping host shared memory
(:mod:`rollouters.engines.vllm_ipc_worker`), fed by the sender the GPU path runs
(:mod:`rollouters.engines.vllm_ipc`). Every update must leave no shared-memory segment behind.
(``asyncrl_gloo``, the default, is what the server tests, the quickstarts and the in-process
engine tests run.)

One engine per module (its start costs seconds). Rows have no EOS (``eos_ids=()``), so every
row runs to ``max_new_tokens``, and the KV cache blocks are 32 tokens (the CPU minimum), so a
36-token prompt fills a block the prefix cache can keep.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.models import load_causal_lm
from tests.engines.learner_checks import learner_mismatch
from tests.engines.test_vllm_engine import LOGPROB_TOLERANCE, PROMPTS, _flat, _patched
from tests.engines.vllm_sleep_checks import (
    check_a_sleep_without_an_update_wakes_with_the_same_weights,
    check_update_while_asleep_lands_at_the_wake,
)
from tests.integration.conftest import wait_for

SHM_DIR = Path("/dev/shm")
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
UPDATE_TIMEOUT_S = 60.0
LONG_PROMPT = [1] + [4 + (i * 7) % 10 for i in range(34)] + [2]  # > one 32-token block
ROWS_LENGTH = 40


def _segments() -> set[str]:
    """The ``asyncrl_shm`` segments on this host now."""
    from rollouters.engines.vllm_ipc import SEGMENT_PREFIX

    return {path.name for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*")}


@pytest.fixture(scope="module")
def async_engine(vllm_env: dict[str, str], tiny_model_dir: Path,
                 reference_state: dict) -> Iterator[object]:
    from rollouters.engines import vllm_weight_backend
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    before, children = _segments(), _children()
    saved = os.environ.get(MULTIPROCESSING)
    os.environ[MULTIPROCESSING] = "1"  # the engine core in a spawned process, as in a run
    try:
        engine = AsyncVLLMEngine(tiny_model_dir, VLLMOptions(
            eos_ids=(), seed=0, max_num_seqs=32, extra={"block_size": 32},
            weight_backend=vllm_weight_backend("ipc", "cpu")), update_timeout_s=UPDATE_TIMEOUT_S)
    finally:
        os.environ[MULTIPROCESSING] = saved or "0"
    engine.core_pids = _children() - children  # for the test that kills it
    try:
        yield engine
    finally:
        engine.close()
    assert _segments() == before  # every update unlinked its segment


def _children() -> set[int]:
    """This process's live children but multiprocessing's resource tracker (the engine core
    is one, once started; vLLM renames it ``VLLM::EngineCore``)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                spawned = b"resource_tracker" not in (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me and fields[0] != "Z" and spawned:
                found.add(int(entry.name))
    return found


@pytest.fixture
def engine(async_engine, reference_state: dict) -> Iterator[object]:
    """The module's engine; whatever a test loads, the initial weights are back afterwards."""
    yield async_engine
    async_engine.load_weights(reference_state.items(), version=async_engine.version + 1)


def _greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their T=1 logprobs, recomputing the whole context each step."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    return tokens, logprobs


def test_async_logprobs_match_learner_recompute(engine, tiny_model_dir: Path) -> None:
    delta, batch = learner_mismatch(engine, tiny_model_dir, seed=2)
    assert float(delta.mean()) < LOGPROB_TOLERANCE
    assert bool((batch.versions[batch.loss_mask] == engine.version).all())


def _tokens_so_far(engine) -> list[int]:
    """Output tokens of each request in flight (the engine's own bookkeeping)."""
    states = list(engine._llm.output_processor.request_states.values())
    return [state.detokenizer.num_output_tokens() for state in states]


def test_async_in_flight_update_tags_each_token_exactly(engine, tiny_model_dir: Path,
                                                        reference_state: dict) -> None:
    """The update lands while every row is mid-flight: each row is old-version tokens, then
    new-version ones, and each part is exactly what its weights make greedily (the new part
    from the full context: vLLM recomputes the kept rows' KV cache under the new weights).

    To land it mid-flight for sure, the engine is paused (requests kept, no step runs), then
    let run a step or so at a time until every row has a token and none has finished."""
    import threading

    old, new = engine.version, engine.version + 1
    patched = _patched(reference_state)
    result: list = []
    engine._run(engine._llm.pause_generation(mode="keep", clear_cache=False))
    thread = threading.Thread(target=lambda: result.append(engine.generate(
        PROMPTS, n=1, temperature=1.0, max_new_tokens=ROWS_LENGTH, greedy=True)))
    try:
        thread.start()
        wait_for(lambda: len(_tokens_so_far(engine)) == len(PROMPTS), 60,
                 "every request queued")

        def step() -> bool:
            engine._run(engine._llm.resume_generation())
            engine._run(engine._llm.pause_generation(mode="keep", clear_cache=False))
            return min(_tokens_so_far(engine)) >= 1

        wait_for(step, 60, "every row's first token", poll_s=0.0)
        assert max(_tokens_so_far(engine)) < ROWS_LENGTH  # none finished
        engine.load_weights(patched.items(), version=new)  # resumes
    finally:
        engine._run(engine._llm.resume_generation())
        thread.join(120)
    old_model, new_model = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    new_model.load_state_dict(patched)
    for prompt, row in zip(PROMPTS, _flat(result[0])):
        switch = row.versions.index(new)
        assert 1 <= switch < ROWS_LENGTH
        assert row.versions == [old] * switch + [new] * (ROWS_LENGTH - switch)
        want_old, lp_old = _greedy(old_model, prompt, switch)
        want_new, lp_new = _greedy(new_model, prompt + want_old, ROWS_LENGTH - switch)
        assert row.tokens == want_old + want_new
        delta = torch.tensor(row.logprobs) - torch.tensor(lp_old + lp_new)
        assert float(delta.abs().max()) < 1e-3


def test_async_prefix_cache_is_reset_by_an_update(engine, tiny_model_dir: Path,
                                                  reference_state: dict) -> None:
    """A repeated prompt is served from the prefix cache, until an update: then it is
    recomputed, and its logprobs are the new weights'."""
    def run() -> tuple[list[float], int]:
        before = engine.cached_prompt_tokens
        (rows,) = engine.generate([LONG_PROMPT], n=1, temperature=1.0, max_new_tokens=4,
                                  greedy=True)
        return rows[0].logprobs, engine.cached_prompt_tokens - before

    run()
    _, cached = run()
    assert cached >= 32  # the prompt's first block came from the cache
    patched = _patched(reference_state)
    engine.load_weights(patched.items(), version=engine.version + 1)
    logprobs, cached = run()
    assert cached == 0
    model = load_causal_lm(tiny_model_dir)
    model.load_state_dict(patched)
    _, want = _greedy(model, LONG_PROMPT, 4)
    assert float((torch.tensor(logprobs) - torch.tensor(want)).abs().max()) < 1e-3


def test_async_update_while_asleep_lands_at_the_wake(engine, tiny_model_dir: Path,
                                                     reference_state: dict) -> None:
    """``launcher.colocate``: sleep, a call that waits, an update held, the wake."""
    check_update_while_asleep_lands_at_the_wake(engine, tiny_model_dir, reference_state)


def test_async_sleep_without_an_update_keeps_the_weights(engine) -> None:
    check_a_sleep_without_an_update_wakes_with_the_same_weights(engine)


def test_async_refused_ipc_update_changes_nothing_and_leaves_the_engine_serving(
        engine, reference_state: dict) -> None:
    """An update with a name the model lacks, after a tensor that fits: vLLM loads tensor by
    tensor, so the engine refuses it before anything is sent (``check_fit``), and its outputs
    are the old weights'. Behind that, the worker half's own refusal (an attached server whose
    model is not the worker's directory, which the check cannot see; here the check is widened
    to let the name through): ``asyncrl_shm`` (vLLM's ipc class with our cleanup) finalizes the
    reload first, so the engine goes on serving and takes the next update, and the segment is
    unlinked."""
    from asyncrl.weights.fit import WeightsRefused

    before = _flat(engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    version, segments = engine.version, _segments()
    bad = {**_patched(reference_state), "model.no_such_layer.weight": torch.zeros(2)}
    with pytest.raises(WeightsRefused, match="no_such_layer"):
        engine.load_weights(bad.items(), version=version + 1)
    assert engine.version == version and _segments() == segments
    unchanged = _flat(engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    assert [c.tokens for c in unchanged] == [c.tokens for c in before]

    shapes = engine._shapes
    engine._shapes = {**shapes, "model.no_such_layer.weight": (2,)}
    try:
        with pytest.raises(Exception, match="no_such_layer"):
            engine.load_weights(bad.items(), version=version + 1)
    finally:
        engine._shapes = shapes
    assert engine.version == version and _segments() == segments
    engine.load_weights(reference_state.items(), version=version + 2)
    again = _flat(engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]


def test_async_engine_core_killed_during_an_update_fails_fast(async_engine,
                                                              reference_state: dict) -> None:
    """The engine core dies during an update (SIGSTOPped first, so the update is surely in
    progress, waiting on it; then SIGKILLed): the update fails at once with vLLM's dead-engine
    error, not after ``weights.timeout_s``, and so does the next generate. The rollout worker
    then leaves the weight group (the learner evicts it) and fails, and its supervisor starts
    a new one: the generic path, tested with the torch engine (test_fleet_changes.py,
    test_weight_broadcast.py). Last in the module: the engine is dead after it."""
    engine, pids = async_engine, async_engine.core_pids
    assert pids, "no engine core process found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    failure: list[BaseException] = []

    def update() -> None:
        try:
            engine.load_weights(_patched(reference_state).items(), version=engine.version + 1)
        except BaseException as exc:  # noqa: BLE001 - what the test checks
            failure.append(exc)

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    wait_for(engine._update_lock.locked, 10, "the update to start")
    start = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    updater.join(UPDATE_TIMEOUT_S + 10)
    took = time.monotonic() - start
    assert not updater.is_alive() and failure, "the update outlived its engine core"
    assert took < UPDATE_TIMEOUT_S / 2, (took, failure)  # the death, not the timeout
    assert type(failure[0]).__name__ == "EngineDeadError", repr(failure[0])
    with pytest.raises(Exception) as dead:
        engine.generate(PROMPTS, 1, 1.0, 4)
    assert dead.type.__name__ == "EngineDeadError", repr(dead.value)
