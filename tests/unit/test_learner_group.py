"""How the learners' process group fails when a rank goes away (real gloo, two processes).

A rank whose peer process died must fail at its next collective rather than wait: gloo sees
the connection close. A peer that stays alive but never joins (a silent host, a rank 0 busy
for too long between steps) is only noticed after ``learner.collective_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from pydantic import ValidationError

from asyncrl.config.schema import LearnerConfig
from asyncrl.net import ReservedPort
from tests.ranks import rank_context

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, port: int, timeout_s: float, peer: str, peer_gone, results) -> None:
    """Rank 1 dies (``peer="dies"``) or sleeps (``"silent"``) after the barrier; rank 0, once
    ``peer_gone`` says so, reports how its next all-reduce ended and how long it took."""
    import torch
    import torch.distributed as dist

    from learners.dist import init_learner_group

    init_learner_group(rank, 2, master_port=port, timeout_s=timeout_s)
    dist.barrier()
    if rank == 1:
        if peer == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        peer_gone.set()   # silent from here on
        time.sleep(60)
        return
    assert peer_gone.wait(60)   # rank 1 has died (the parent reaped it) or gone to sleep
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        results.put(("completed", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - the failure is what is measured
        results.put((type(exc).__name__, time.monotonic() - start))


def _run(timeout_s: float, peer: str) -> tuple[str, float]:
    ctx = rank_context()
    results, peer_gone, reserved = ctx.Queue(), ctx.Event(), ReservedPort()
    procs = [ctx.Process(target=_rank,
                         args=(r, reserved.port, timeout_s, peer, peer_gone, results),
                         daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        if peer == "dies":
            procs[1].join(60)
            assert procs[1].exitcode == -signal.SIGKILL, procs[1].exitcode
            peer_gone.set()
        return results.get(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
        reserved.close()


def test_a_dead_peer_fails_the_next_collective_at_once() -> None:
    outcome, waited = _run(timeout_s=60.0, peer="dies")
    assert outcome != "completed"
    assert waited < 10.0  # far below the 60 s timeout: the closed connection was seen


def test_a_silent_peer_fails_the_collective_after_the_configured_timeout() -> None:
    outcome, waited = _run(timeout_s=2.0, peer="silent")
    assert outcome != "completed"
    assert 2.0 <= waited < 30.0


def test_collective_timeout_is_a_learner_key_with_a_safe_default() -> None:
    assert LearnerConfig().collective_timeout_s == 300.0
    with pytest.raises(ValidationError, match="collective_timeout_s"):
        LearnerConfig(collective_timeout_s=0)
