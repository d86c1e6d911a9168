"""`asyncrl plot RUN_DIR`: the monitor's curves, drawn from ``metrics.jsonl`` to PNG files.

One file per question a user asks of a finished (or running) run: is it learning
(``reward.png``), how off-policy was the data (``staleness.png``), how fast did it go
(``throughput.png``), who waited for whom (``idle.png``), and did the engines agree with the
learner (``mismatch.png``, when the run recorded it). Matplotlib's Agg backend: no display.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.snapshot import (MISMATCH, REWARD, STALENESS_MAX, STALENESS_MEAN,
                              TRAINED_TOKENS_PER_S, learner_idle)
from asyncrl.metrics import VAL_SCORE, read_jsonl

logger = logging.getLogger(__name__)

Record = Mapping[str, Any]
Picker = Callable[[Sequence[Record]], tuple[list[int], list[float]]]
Curve = tuple[str, Picker, dict[str, Any]]  # label, (steps, values) from records, line style
DASHED = {"linestyle": "--", "zorder": 1}  # a bound drawn under the curve it bounds


def series(key: str) -> Picker:
    """(steps, values) of one metric over the records that carry it."""
    def pick(records: Sequence[Record]) -> tuple[list[int], list[float]]:
        rows = [(r["step"], _value(r[key])) for r in records if key in r]
        return [s for s, _ in rows], [v for _, v in rows]
    return pick


def _learner_idle(records: Sequence[Record]) -> tuple[list[int], list[float]]:
    rows = [(r["step"], learner_idle(r)) for r in records]
    return [s for s, v in rows if v is not None], [v for _, v in rows if v is not None]


def _engine_idle(records: Sequence[Record]) -> tuple[list[int], list[float]]:
    """Share of the fleet's time held by the closed gate between two logged steps: the growth
    of the summed ``rollout/gate_wait_s`` over elapsed time × live workers."""
    rows = [r for r in records if r.get("rollout/workers") and _number(r.get("time_s"))
            and _number(r.get("rollout/gate_wait_s"))]
    steps, values = [], []
    for prev, cur in zip(rows, rows[1:]):
        elapsed = (cur["time_s"] - prev["time_s"]) * cur["rollout/workers"]
        if elapsed > 0:
            waited = max(0.0, cur["rollout/gate_wait_s"] - prev["rollout/gate_wait_s"])
            steps.append(cur["step"])
            values.append(min(1.0, waited / elapsed))
    return steps, values


def _val_score(records: Sequence[Record]) -> tuple[list[int], list[float]]:
    rows = [(r["step"], v) for r in records for k, v in r.items() if k.startswith(VAL_SCORE)]
    return [s for s, _ in rows], [_value(v) for _, v in rows]


def _value(value: Any) -> float:
    """A recorded figure; null, how orjson writes NaN and inf (a diverged step), is a gap."""
    return math.nan if value is None else float(value)


def _number(value: Any) -> bool:
    """Not null (orjson's NaN or inf) nor missing."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


FIGURES: dict[str, tuple[str, str, list[Curve]]] = {
    "reward": ("reward", "reward", [("train reward (mean)", series(REWARD), {}),
                                    ("held-out greedy score", _val_score, {"marker": "o"})]),
    "staleness": ("staleness of consumed samples", "versions behind",
                  [("mean", series(STALENESS_MEAN), {"zorder": 2}),
                   ("max", series(STALENESS_MAX), DASHED)]),
    "throughput": ("throughput", "tokens/s",
                   [("trained", series(TRAINED_TOKENS_PER_S), {}),
                    ("generated", series("rollout/tokens_per_s"), {})]),
    "idle": ("idle ratios", "fraction of time",
             [("learner (waiting for data)", _learner_idle, {}),
              ("engines (held by the gate)", _engine_idle, {})]),
    "mismatch": ("train vs rollout mismatch", "mean |Δ logp|",
                 [("|Δ logp|", series(MISMATCH), {})]),
}


class NothingToPlot(FileNotFoundError):
    """The run directory has no metrics.jsonl, or no learner step in it yet: a user's mistake
    (or a run that has not trained), reported by `asyncrl plot` in one line."""


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per figure that has data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise NothingToPlot(f"{metrics} not found: is {run_dir} a run directory?")
    records = [r for r in read_jsonl(metrics) if isinstance(r.get("step"), int)]
    if not records:
        raise NothingToPlot(f"{metrics} has no learner steps yet")
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, curves) in FIGURES.items():
        drawn = [(label, *pick(records), style) for label, pick, style in curves]
        if any(steps for _, steps, _, _ in drawn):
            written.append(_figure(out_dir / f"{name}.png", f"{run_dir.name}: {title}", ylabel,
                                   drawn))
    return written


def _figure(path: Path, title: str, ylabel: str,
            curves: list[tuple[str, list[int], list[float], dict[str, Any]]]) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for label, steps, values, style in curves:
        if steps:
            ax.plot(steps, values, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("learner step (version)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.savefig(path)
    logger.info("wrote %s", path)
    return path
