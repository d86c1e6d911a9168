"""The monitor in the colocated mode: sleeping engines, the learner's phase, the handover."""

from __future__ import annotations

from asyncrl.dashboard import learner_time_split
from learners.colocate import TRAINING
from tests.unit.test_dashboard import row, screen, snapshot


def _colocated() -> tuple[dict, object, str]:
    status, history = snapshot()
    name = next(n for n, m in status["members"].items() if m["role"] == "rollout")
    status["members"][name]["info"]["phase"] = "asleep"
    learner = next(m for m in status["members"].values() if m["role"] == "learner")
    learner["info"].update({"state": TRAINING, "colocate/handover_s": 0.25,
                            "colocate/sleep_s": 0.125, "colocate/onload_s": 0.05,
                            "colocate/offload_s": 0.0625, "colocate/wake_s": 0.02})
    return status, history, name


def test_the_phase_and_the_handover_are_on_screen() -> None:
    status, history, name = _colocated()
    text = screen(status, history)
    assert row(text, name).strip("│ ").split()[1] == "asleep"
    assert f"({TRAINING})" in text.splitlines()[0]
    assert "sleep 0.125 · in 0.050 · out 0.062 · wake 0.020 s" in text
    assert "colocated handover" in text
    assert "GiB" not in text   # on CPU no device memory is recorded


def test_on_cuda_the_memory_of_each_phase_is_on_screen() -> None:
    status, history, _ = _colocated()
    learner = next(m for m in status["members"].values() if m["role"] == "learner")
    learner["info"].update({"colocate/learner_gib_peak": 31.5, "colocate/learner_gib_out": 0.25,
                            "colocate/engines_gib_peak": 40.0,
                            "colocate/engines_gib_asleep": 0.5})
    text = screen(status, history)
    assert "peak→kept GiB: learner 31.5→0.25 · engines 40.0→0.50" in text


def test_the_handover_is_a_part_of_the_step() -> None:
    status, _, _ = _colocated()
    learner = next(m for m in status["members"].values() if m["role"] == "learner")
    split = learner_time_split(learner["info"])
    assert ("colocated handover", 0.25) in split.parts
    assert "colocated handover" not in [p for p, _ in
                                        learner_time_split({"timing/step": 1.0}).parts]
