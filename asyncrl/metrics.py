"""Metrics plumbing shared by every role: a crash-safe JSONL writer, timers and rate meters.

One flat dict per learner step (a line of ``metrics.jsonl``, the learner's heartbeat) carries
every name below. The names follow verl's where verl has one, so dashboards and habits carry
over; asyncrl's own concerns get their own namespaces. Times are seconds.

=============================  ==============================================================
``training/global_step``       the learner version V after this step (also ``step``)
``actor/loss``                 the policy objective (``learner.loss``), global mean
``actor/entropy``              token-mean entropy of the policy on trained tokens, pre-update
``actor/ppo_ratio_mean``       token-mean ratio π/π_old (π_old: behaviour, or the proximal
                               policy with decoupled PPO; GSPO: the sequence ratio)
``actor/clipfrac``             fraction of trained tokens where the clip (or IS cap) is active
``actor/is_capped_frac``       decoupled PPO: tokens whose behaviour weight hit the cap
``actor/kl_loss``              token-mean KL estimate to the frozen reference (``kl_coef > 0``)
``actor/grad_norm``            pre-clip global gradient norm
``actor/lr``                   learning rate of this step
``critic/score/mean``          mean task reward of the trained samples
``critic/rewards/mean``        mean reward after the KL penalty (= score without
                               ``kl_in_reward``)
``critic/advantages/mean``     token-mean advantage on trained tokens (``/max``, ``/min``)
``critic/loss``                GAE critic: value loss (``critic/values/mean``, ``grad_norm``,
                               ``lr``)
``response_length/mean``       generated tokens per trained sample (``/max``, ``/min``)
``perf/trained_tokens``        trained tokens in the step (all ranks)
``perf/trained_tokens_per_s``  trained tokens over the step's wall time
``perf/tflops``                the model's FLOPs of the step (``learners.flops``) per
                               learner device and second of ``timing/train_step``
``perf/mfu``                   ``perf/tflops`` over the device's dense bf16 peak (by GPU
                               name, or ``learner.peak_tflops``; absent on a CPU)
``perf/compiles``              ``learner.compile``: graphs compiled during the step (0 once
                               warm; rising every step means recompiles)
``val/test_score/<task>``      held-out greedy score (``eval.every_steps``): exact-match
                               accuracy (digit tasks) or mean return (workflows, whose
                               exact rate is ``val/success/<task>``);
                               ``val/position_score/<task>``, ``val/num_prompts/<task>``
``staleness/mean``, ``/max``   V − min token version of the consumed samples;
                               ``staleness/consumed_version_min``, ``…_max``
``mismatch/*``                 train-vs-rollout logprob mismatch (``learners.mismatch``)
``timing/step``                wall time of the whole learner step, data wait included
``timing/wait_data``           waiting for the buffer; ``timing/compute`` the optimizer step
                               (``timing/train_step``: the slowest rank's; ``timing/scatter``:
                               rank 0 splitting the batch and sending the shares; both inside
                               compute), ``timing/gather`` the full-state gather,
                               ``timing/weight_wait`` waiting for the previous delivery: four
                               disjoint parts of ``timing/step``
``timing/weight_sync``         the broadcast to the engines (``timing/weight_send``,
                               ``timing/weight_ack``). With ``weights.overlap`` (the default)
                               it is the previous version's (``weights/version``), which ran
                               on its own thread during this step: not a part of the step
``weights/*``                  the broadcast: bytes, members, evicted, buckets, epoch
``buffer/*``, ``rollout/*``    the buffer's counters; the rollout fleet's totals
``reward/*``                   reward calls summed over the rollout workers: ``ok``,
                               ``failed``, one per failure reason (``timeout``,
                               ``error:<type>`` ...), ``replaced`` (processes, threads)
``filter/*``                   groups dropped by DAPO / finish-reason filters
=============================  ==============================================================
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line.

    A file that a crash left with a torn last line is cut back to its last whole line when
    opened: appended to as it was, the next record joined the torn one and was lost too."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        _cut_torn_tail(path)
        self._file = path.open("ab")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()

    def started_from(self, version: int) -> None:
        """The learner goes on from ``version``: the records of later steps (and what follows
        them) move to ``metrics.superseded-<time>.jsonl`` (:func:`set_aside_after`)."""
        self._file.close()
        set_aside_after(self.path, version)
        self._file = self.path.open("ab")

    def close(self) -> None:
        self._file.close()


def _cut_torn_tail(path: Path) -> None:
    """Only the last byte is read, unless it is torn (a learner start reads no whole file)."""
    if not path.exists():
        return
    with path.open("r+b") as file:
        if file.seek(0, 2) == 0:
            return
        file.seek(-1, 2)
        if file.read(1) == b"\n":
            return
        file.seek(0)
        file.truncate(file.read().rfind(b"\n") + 1)


def _step_after(line: bytes, version: int) -> bool:
    try:
        step = orjson.loads(line).get("step")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(step, int) and step > version


def set_aside_after(path: Path, version: int) -> Path | None:
    """Move the records from the first one of a step after ``version`` on (the final eval's
    record after it included) to ``metrics.superseded-<time>.jsonl`` beside ``path``;
    returns that file, None when there were none.

    Why: a learner that goes on from ``version`` (a checkpoint behind the last record, with
    a buffer that did not outlive the learner; a fresh start with ``checkpoint.resume =
    false``) writes those steps again, and ``metrics.jsonl`` then held two records of each,
    which the plots and the monitor drew as one zigzag curve. Records are in step order, as
    one learner line writes them, and this keeps them so."""
    if not path.exists():
        return None
    lines = path.read_bytes().splitlines(keepends=True)
    cut = next((i for i, line in enumerate(lines) if _step_after(line, version)), len(lines))
    if cut == len(lines):
        return None
    aside = path.with_name(f"{path.stem}.superseded-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with aside.open("ab") as file:  # two starts within a second: both sets are kept
        file.writelines(lines[cut:])
    kept = path.with_name(f".{path.name}.tmp")
    kept.write_bytes(b"".join(lines[:cut]))
    kept.replace(path)
    logger.warning("%s: the records of steps after %d moved to %s (this learner goes on "
                   "from version %d)", path, version, aside.name, version)
    return aside


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in path.read_bytes().splitlines():
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return records


VAL_SCORE = "val/test_score/"


def val_score_key(task: str) -> str:
    """``val/test_score/<task>``: the held-out score of one task."""
    return f"{VAL_SCORE}{task}"


def val_score(record: Mapping[str, Any]) -> float | None:
    """The held-out score in a record (the first task's, when several), or None."""
    for key, value in record.items():
        if key.startswith(VAL_SCORE):
            return value
    return None


class Timers:
    """Accumulates wall time per phase: ``with timers("wait_data"): ...``; ``pop()`` resets.
    Phases may nest (the learner's ``scatter`` inside ``compute``): only phases that do not
    are disjoint parts of a step, to be added up."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def pop(self, prefix: str = "timing/") -> dict[str, float]:
        """``{prefix + phase: seconds}`` since the last pop."""
        totals, self._totals = self._totals, {}
        return {f"{prefix}{name}": round(value, 6) for name, value in totals.items()}


class RateMeter:
    """Events per second over a sliding window (tokens/s that reflects now, not the average)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._start = time.monotonic()
        self.total = 0.0

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        self.total += amount
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        # Divide by the window (or the time since start, early on): a single burst must not
        # read as an enormous rate.
        span = max(min(self._window_s, now - self._start), 1e-3)
        return sum(amount for _, amount in self._events) / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self._window_s:
            self._events.popleft()
