"""A vLLM server, attached through its RL routes (real server subprocess).

The server is launched as a rollout worker launches its own (:class:`VLLMServer`), with the
command docs/engines.md gives an operator (``python -m rollouters.engines.vllm_launch``: the
same function, checked first); the engine under test only talks HTTP to it.

Its weights come by ``asyncrl_gloo``, the default (``weights.transport = "auto"`` on CPU and
on GPUs): the update's description over HTTP while this process broadcasts the tensors on the
transfer group the server joined. ``weights.transport = "ipc"`` (``asyncrl_shm`` on CPU) is
tested with the AsyncLLM engine (``test_vllm_async.py``).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.models import EOS_ID
from tests.engines.learner_checks import learner_mismatch
from tests.engines.test_vllm_engine import (
    LOGPROB_TOLERANCE,
    PROMPTS,
    _flat,
    _patched,
    _reference_engine,
)
from tests.engines.vllm_sleep_checks import (
    check_a_sleep_without_an_update_wakes_with_the_same_weights,
    check_update_while_asleep_lands_at_the_wake,
)
from tests.integration.conftest import wait_for

MAX_NUM_SEQS = 128
def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_the_documented_command_is_the_launched_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m rollouters.engines.vllm_launch`` (docs/engines.md) runs the command a worker
    launches its own servers with (:class:`VLLMServer`, tested below): the same function."""
    from rollouters.engines import vllm_launch

    ran: list[list[str]] = []
    monkeypatch.setattr(vllm_launch.os, "execvpe", lambda _, argv, env: ran.append(argv))
    vllm_launch.main(["/m", "--port", "8123", "--device", "cpu", "--", "--max-num-seqs", "9"])
    assert ran == [vllm_launch.command("/m", "127.0.0.1", 8123, "cpu", ["--max-num-seqs", "9"])]


@pytest.fixture(scope="module")
def server_url(vllm_env: dict[str, str], tiny_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server launched as a worker launches its own (``rollout.engine = "vllm-server"``
    without ``rollout.url``), with ``max_num_seqs`` rows at once (every row of the in-flight
    test) and one test-only flag: ``/load`` counts the generate requests the server holds."""
    from rollouters.engines.vllm_fleet import VLLMServer
    from rollouters.engines.vllm_options import VLLMOptions

    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    opts = VLLMOptions(eos_ids=(EOS_ID,), max_num_seqs=MAX_NUM_SEQS)
    server = VLLMServer(tiny_model_dir, opts, log, start_timeout_s=180,
                        extra_flags=("--enable-server-load-tracking",))
    try:
        yield server.url
    finally:
        server.stop()
        assert not server.running


@pytest.fixture(scope="module")
def server_engine(server_url: str, reference_state: dict):
    """Attached and synced once (that inits the transfer, as a worker's first update)."""
    from rollouters.engines.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine(server_url, eos_ids=(EOS_ID,))
    assert engine.version == 0
    engine.load_weights(reference_state.items(), version=0)
    yield engine
    engine.close()


def test_server_logprobs_match_learner(server_engine, tiny_model_dir: Path) -> None:
    delta, batch = learner_mismatch(server_engine, tiny_model_dir, seed=1)
    assert float(delta.mean()) < LOGPROB_TOLERANCE
    assert bool((batch.versions[batch.loss_mask] == 0).all())


def test_server_update_changes_outputs(server_engine, tiny_model_dir: Path,
                                       reference_state: dict) -> None:
    before = _flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    patched = _patched(reference_state)
    server_engine.load_weights(patched.items(), version=1)
    try:
        assert torch.equal(server_engine.weight("model.norm.weight"), patched["model.norm.weight"])
        after = _flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
        expected = _flat(_reference_engine(tiny_model_dir, patched).generate(
            PROMPTS, 1, 1.0, 8, greedy=True))
        assert [c.tokens for c in after] == [c.tokens for c in expected]
        assert [c.tokens for c in after] != [c.tokens for c in before]
        assert all(set(c.versions) == {1} for c in after)
    finally:
        server_engine.load_weights(reference_state.items(), version=2)
    again = _flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]
    assert all(set(c.versions) == {2} for c in again)


def test_server_update_while_asleep_lands_at_the_wake(server_engine, tiny_model_dir: Path,
                                                      reference_state: dict) -> None:
    """``launcher.colocate`` over HTTP: ``/sleep``, a generate call that waits, an update held
    for the wake, ``/wake_up`` by tags: the call returns the new version's greedy tokens and
    logprobs (the in-process engines' check, on this module's server)."""
    check_update_while_asleep_lands_at_the_wake(server_engine, tiny_model_dir, reference_state)


def test_server_sleep_without_an_update_wakes_with_the_same_weights(server_engine) -> None:
    check_a_sleep_without_an_update_wakes_with_the_same_weights(server_engine)


def _post(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                                timeout=30) as response:
        return response.read().decode()


def _engine_counts(url: str) -> dict[str, float]:
    """The engine's request counts from /metrics: running and waiting rows, finished rows (all
    reasons summed). While the server is paused they stand still: no step runs."""
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:request_success_total": "finished"}
    counts = dict.fromkeys(names.values(), 0.0)
    for line in _get(f"{url}/metrics").splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            counts[names[name]] += float(line.rsplit(" ", 1)[1])
    return counts


def _step_until_all_run(url: str, rows: int) -> dict[str, float]:
    """Let the paused server run a step or so at a time (resume, then pause at once: one step
    when measured) until ``rows`` rows have run, and return its counts, read while it is paused
    again: they stand still then."""
    before = _engine_counts(url)["finished"]
    counts: dict[str, float] = {}

    def step() -> bool:
        _post(f"{url}/resume")
        _post(f"{url}/pause?mode=keep")
        counts.update(_engine_counts(url))
        return counts["running"] + counts["finished"] - before >= rows

    wait_for(step, 60, f"{rows} rows to run", poll_s=0.05)
    return {**counts, "finished": counts["finished"] - before}


def test_server_in_flight_update_keeps_requests(server_engine, server_url: str,
                                                reference_state: dict) -> None:
    """An update while long requests run: they are kept (not aborted), and each row's tokens
    switch from the old version to the new one exactly once, as the server recorded.

    The update must land while every row is generating, which no amount of waiting for tokens
    can promise (under load the rows finished before the update did). So the server is paused
    (``/pause?mode=keep``: requests queue, no step runs) before the rows are sent, and let run
    a step or so at a time until every row is running, none finished: each has sampled its
    first token at the old version and has dozens to go. The update is then made while the
    server is still paused in the state observed, so every row must see both versions."""
    from rollouters.engines.vllm_server import VLLMServerEngine

    n, length = 8, 48
    prompts = (PROMPTS * MAX_NUM_SEQS)[:MAX_NUM_SEQS // n]  # 16 requests, 128 rows: one batch
    rows = len(prompts) * n
    long_rows = VLLMServerEngine(server_url, eos_ids=())  # rows run to max_new_tokens
    old, new = server_engine.version, server_engine.version + 1
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        long_rows.generate(prompts, n=n, temperature=1.0, max_new_tokens=length)))
    _post(f"{server_url}/pause?mode=keep")
    try:
        thread.start()
        wait_for(lambda: json.loads(_get(f"{server_url}/load"))["server_load"] == len(prompts),
                 60, "the server to hold every request")
        counts = _step_until_all_run(server_url, rows)
        assert counts["running"] == rows and counts["finished"] == 0, counts  # all mid-flight
        server_engine.load_weights(reference_state.items(), version=new)  # then resumes
    finally:
        _post(f"{server_url}/resume")
        thread.join(120)
    completions = _flat(result[0])
    assert len(completions) == rows
    assert all(len(c.tokens) == length and c.finish_reason == "length" for c in completions), \
        [(len(c.tokens), c.finish_reason, c.tokens[-1]) for c in completions]
    for completion in completions:
        assert completion.versions == sorted(completion.versions)
        assert set(completion.versions) == {old, new}, completion.versions


def test_a_refused_update_leaves_the_server_serving(server_engine,
                                                   reference_state: dict) -> None:
    """An update the worker refuses at its last tensor (a name the model lacks, after every
    layer took its tensors) fails at once, and the worker half (``asyncrl_gloo`` here) finalizes
    the reload before the error goes up: the server goes on serving and takes the next update.
    (vLLM's own ipc class does not: it left the layers on the meta device, and its engine core
    died at the next step, "Tensor on device cpu is not on the expected device meta!"; ours,
    ``asyncrl_ipc`` / ``asyncrl_shm``, cleans up as the gloo half does:
    ``test_vllm_async.py``.)"""
    from rollouters.engines.vllm_server import ServerError

    before = _flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    version = server_engine.version
    bad = {**_patched(reference_state), "model.no_such_layer.weight": torch.zeros(2)}
    with pytest.raises(ServerError, match="no_such_layer"):
        server_engine.load_weights(bad.items(), version=version + 1)
    assert server_engine.version == version
    assert len(_flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))) == len(PROMPTS)
    server_engine.load_weights(reference_state.items(), version=version + 2)
    again = _flat(server_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]
