"""The parts of the vLLM engines' sleep that need no vLLM (``rollouters.engines.vllm_sleep``):
an update held while asleep, the gate generate calls wait at, and what an engine reports.
The sequence against a real vLLM is ``tests/engines/vllm_sleep_checks.py``'s."""

from __future__ import annotations

import threading

import torch

from rollouters.engines.vllm_sleep import GenerateGate, HeldUpdate, memory_report, wake_in_order


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
    wake_in_order(calls.append, held, lambda tensors, version: calls.append(version))
    assert calls == [["weights"], 5, ["kv_cache"]]

    def fails(tensors: object, version: int) -> None:
        raise RuntimeError("transfer group gone")

    calls.clear()
    held.hold([("w", torch.ones(1))], version=6)
    wake_in_order(calls.append, held, fails)  # logged: the engine still wakes, fully
    assert calls == [["weights"], ["kv_cache"]]


def test_memory_report_says_what_vllms_sleep_freed() -> None:
    sizes = {"weights_bytes": 100, "kv_bytes": 50}
    assert memory_report(sizes, asleep=False, frees=True, held_bytes=0) == {
        "weights_bytes": 100, "kv_bytes": 50, "host_bytes": 0, "sleep_frees_memory": 1}
    assert memory_report(sizes, asleep=True, frees=True, held_bytes=8) == {
        "weights_bytes": 0, "kv_bytes": 0, "host_bytes": 108, "sleep_frees_memory": 1}
    # CPU: vLLM's sleep is a no-op, so the engine still holds everything
    assert memory_report(sizes, asleep=True, frees=False, held_bytes=8) == {
        "weights_bytes": 100, "kv_bytes": 50, "host_bytes": 8, "sleep_frees_memory": 0}
