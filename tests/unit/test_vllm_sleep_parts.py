"""The parts of the engines' sleep that need no server (``rollouters.engines.vllm_sleep``):
an update held or deferred while asleep, the gate generate calls wait at, the cycle every
sleeping vLLM and SGLang engine runs, and what an engine reports.
The sequence against a real vLLM is ``tests/engines/vllm_sleep_checks.py``'s."""

from __future__ import annotations

import threading

import pytest
import torch

from rollouters.engines.vllm_sleep import (
    DeferredUpdate,
    GenerateGate,
    HeldUpdate,
    SleepCycle,
    memory_report,
    wake_in_order,
)


def test_updates_held_while_asleep_merge_by_name_and_keep_the_newest_version() -> None:
    held = HeldUpdate()
    assert held.take() is None
    a, b = torch.ones(4), torch.zeros(2)
    held.hold([("a", a), ("b", b)], version=3)
    a.fill_(7)  # the receiver reuses its buffers: the held copy must not change
    held.hold([("a", torch.full((4,), 2.0))], version=4)
    assert held.nbytes == 6 * 4
    tensors, version = held.take()
    assert version == 4 and dict(tensors)["a"].tolist() == [2.0] * 4
    assert dict(tensors)["b"].tolist() == [0.0, 0.0]
    assert held.take() is None and held.nbytes == 0


def test_the_gate_waits_for_calls_in_flight_and_holds_new_ones() -> None:
    gate = GenerateGate()
    inside, release, entered = threading.Event(), threading.Event(), []

    def call(tag: str) -> None:
        with gate.call():
            entered.append(tag)
            inside.set()
            release.wait(10)

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert inside.wait(10)
    closing = threading.Thread(target=gate.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # waits for the call in flight
    release.set()
    closing.join(10)
    assert gate.closed
    second = threading.Thread(target=call, args=("second",))
    second.start()
    second.join(0.2)
    assert entered == ["first"]  # a call made while closed waits
    gate.open()
    second.join(10)
    assert entered == ["first", "second"]


def test_the_wake_applies_the_held_update_between_weights_and_kv_cache() -> None:
    calls: list[object] = []
    held = HeldUpdate()
    held.hold([("w", torch.ones(1))], version=5)
    wake_in_order(calls.append,
                  lambda: held.apply_with(lambda tensors, version: calls.append(version)))
    assert calls == [["weights"], 5, ["kv_cache"]]

    def fails(tensors: object, version: int) -> None:
        raise RuntimeError("transfer group gone")

    calls.clear()
    held.hold([("w", torch.ones(1))], version=6)
    wake_in_order(calls.append, lambda: held.apply_with(fails))  # logged; it still wakes
    assert calls == [["weights"], ["kv_cache"]]


def test_a_deferred_update_runs_at_the_wake_and_its_caller_gets_the_outcome() -> None:
    """SGLang's case: the update is a call (its server receives the weights), its thread waits
    for the wake, which runs it between the two wakes; an error reaches both sides."""
    deferred, calls, outcome = DeferredUpdate(), [], []
    waiting = deferred.defer(lambda: calls.append("update"))
    waiter = threading.Thread(target=lambda: outcome.append(deferred.wait(waiting, 30)))
    waiter.start()
    wake_in_order(calls.append, deferred.run)
    waiter.join(30)
    assert calls == [["weights"], "update", ["kv_cache"]] and outcome == [True]

    def fails() -> None:
        raise RuntimeError("group gone")

    errors: list[BaseException] = []
    waiting = deferred.defer(fails)

    def bring() -> None:
        try:
            deferred.wait(waiting, 30)
        except RuntimeError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=bring)
    waiter.start()
    calls.clear()
    wake_in_order(calls.append, deferred.run)  # logged; the engine still wakes, fully
    waiter.join(30)
    assert calls == [["weights"], ["kv_cache"]] and [str(e) for e in errors] == ["group gone"]


def test_a_deferred_update_no_wake_runs_is_withdrawn() -> None:
    deferred, calls = DeferredUpdate(), []
    assert deferred.wait(deferred.defer(lambda: calls.append("update")), 0.05) is False
    deferred.run()  # a later wake finds nothing to run
    assert calls == []


def test_a_second_deferred_update_is_refused() -> None:
    deferred = DeferredUpdate()
    first = deferred.defer(lambda: None)
    with pytest.raises(RuntimeError, match="already waiting"):
        deferred.defer(lambda: None)
    deferred.run()
    assert deferred.wait(first, 1)


def test_a_failed_sleep_leaves_the_engine_awake_and_its_wake_calls_nothing() -> None:
    """Every engine's cycle (:class:`SleepCycle`): a server that refuses to sleep leaves the
    gate open; a wake then only opens it (no wake call to a server that never slept)."""
    cycle, calls = SleepCycle(threading.Lock()), []

    def refuses() -> None:
        raise RuntimeError("HTTP 500")

    with pytest.raises(RuntimeError, match="HTTP 500"):
        cycle.sleep(refuses)
    assert not cycle.asleep and not cycle.in_server
    cycle.wake(calls.append, lambda: calls.append("held"))
    assert calls == []
    cycle.sleep(lambda: calls.append("sleep"))
    assert cycle.asleep and cycle.in_server
    cycle.wake(calls.append, lambda: calls.append("held"))
    assert calls == ["sleep", ["weights"], "held", ["kv_cache"]] and not cycle.asleep


def test_memory_report_says_what_vllms_sleep_freed() -> None:
    sizes = {"weights_bytes": 100, "kv_bytes": 50}
    assert memory_report(sizes, asleep=False, frees=True, held_bytes=0) == {
        "weights_bytes": 100, "kv_bytes": 50, "host_bytes": 0, "sleep_frees_memory": 1}
    assert memory_report(sizes, asleep=True, frees=True, held_bytes=8) == {
        "weights_bytes": 0, "kv_bytes": 0, "host_bytes": 108, "sleep_frees_memory": 1}
    # CPU: vLLM's sleep is a no-op, so the engine still holds everything
    assert memory_report(sizes, asleep=True, frees=False, held_bytes=8) == {
        "weights_bytes": 100, "kv_bytes": 50, "host_bytes": 8, "sleep_frees_memory": 0}
