"""The monitor's screen as a pure function of what it is shown: ``dashboard(status, history)``.

``status`` is the buffer's ``status()`` (``asyncrl status --json``): its counters, the staleness
histogram, and every member's last heartbeat (the learner's is its last metrics record, a
rollout worker's its engine version, tokens/s and time split). ``history``
(:class:`asyncrl.snapshot.History`) keeps the per-step series the sparklines draw, since a
status snapshot only holds the latest step. Nothing here reads a socket or a clock, so tests
render it to text exactly as a terminal shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from asyncrl.metrics import val_score
from asyncrl.snapshot import (MFU, MISMATCH, REWARD, STALENESS_MAX, STALENESS_MEAN, STEP_TIME,
                              TRAINED_TOKENS_PER_S, WAIT_DATA, History, engine_idle, evictions,
                              fleet_idle, learner_idle, learner_info, rollouts)

COMPUTE, GATHER = "timing/compute", "timing/gather"
HANDOVER = "colocate/handover_s"
WEIGHT_SYNC, WEIGHT_WAIT = "timing/weight_sync", "timing/weight_wait"
SPARK_CHARS = "▁▂▃▄▅▆▇█"
BAR, BAR_BESIDE = "█", "░"  # a part of the step / work that overlapped it
OVERLAPPED = "∥"  # marks a time split line that ran beside the step, not inside it


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """The last ``width`` values as block characters scaled between their min and max."""
    shown = [v for v in values if v == v][-width:]  # NaN (a step without the value) skipped
    if not shown:
        return ""
    lo, hi = min(shown), max(shown)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[0 if hi == lo else round((v - lo) / (hi - lo) * top)]
                   for v in shown)


def bar(fraction: float, width: int, char: str = BAR) -> str:
    return char * round(max(0.0, min(1.0, fraction)) * width)


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def dashboard(status: Mapping[str, Any], history: History | None = None) -> RenderableType:
    """The whole screen: header, engines, staleness and buffer, learner time, curves."""
    history = history or History()
    return Group(_header(status), _engines(status, history),
                 _SideBySide(_staleness(status), _buffer(status)),
                 _SideBySide(_time_split(status, history), _curves(status, history)))


SIDE_BY_SIDE_MIN_WIDTH = 100  # narrower terminals stack the panels instead


class _SideBySide:
    """Two panels in one row on a wide terminal, one above the other on a narrow one."""

    def __init__(self, left: RenderableType, right: RenderableType) -> None:
        self.left, self.right = left, right

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if options.max_width < SIDE_BY_SIDE_MIN_WIDTH:
            yield self.left
            yield self.right
            return
        grid = Table.grid(expand=True, padding=(0, 1))
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(self.left, self.right)
        yield grid


def _header(status: Mapping[str, Any]) -> Text:
    info = learner_info(status)
    text = Text.assemble(
        ("asyncrl ", "bold"), f"run {status.get('run_id') or '?'} · ",
        (str(status.get("run_status", "?")), "bold green" if status.get("run_status") ==
         "running" else "bold"),
        f" · up {status.get('uptime_s', 0):.0f}s · ", ("learner ", "bold"),
        (f"v{status.get('version', 0)}", "bold cyan"),
        (f" ({info['state']})" if info.get("state") else "", "yellow"),
        f" · reward {fmt(info.get(REWARD))} · val {fmt(val_score(info))}"
        f" · train {fmt(info.get(TRAINED_TOKENS_PER_S), ',.0f')} tok/s"
        + (f" · mfu {100 * info[MFU]:.1f}%" if MFU in info else ""))
    return text


def _engines(status: Mapping[str, Any], history: History) -> Panel:
    """One row per engine; an engine the weight sync evicted says so in place of ``alive``
    (a frozen one is still alive to the buffer), and why under the table."""
    table = Table(expand=True, box=None, header_style="bold")
    for name, justify in (("engine", "left"), ("alive", "left"), ("version", "right"),
                          ("lag", "right"), ("tok/s", "right"), ("groups", "right"),
                          ("heartbeat", "right"), ("idle", "right")):
        table.add_column(name, justify=justify)
    version, total = status.get("version", 0), 0.0
    evicted = evictions(status)
    for name, member in rollouts(status).items():
        info = member.get("info", {})
        ev = info.get("engine_version")
        alive = bool(member.get("alive"))
        total += info.get("tokens_per_s", 0.0) if alive else 0.0
        table.add_row(name, _alive(alive, name in evicted, info.get("phase") == "asleep"),
                      fmt(ev, "d"), fmt(None if ev is None else _lag(version, ev), "d"),
                      f"{info.get('tokens_per_s', 0.0):,.0f}", str(info.get("groups", 0)),
                      f"{member.get('last_seen_s_ago', 0.0):.1f}s ago",
                      pct(engine_idle(info, history.engine_window.get(name))))
    title = f"engines · {total:,.0f} tok/s generated · idle {pct(fleet_idle(status, history))}"
    notes = [Text(f"weights: evicted {name}: {why}", "yellow") for name, why in evicted.items()]
    return Panel(Group(table, *notes), title=title, title_align="left")


def _alive(alive: bool, evicted: bool, asleep: bool = False) -> Text:
    if evicted:
        return Text("evicted", "bold yellow")
    if alive and asleep:   # launcher.colocate: the learner has the device
        return Text("asleep", "blue")
    return Text("yes" if alive else "no", "green" if alive else "red")


def _lag(version: int, engine_version: int) -> int:
    """Versions an engine is behind the published one. An engine has the learner's next
    weights a moment before the version is published (after every engine has acked them): it
    is then up to date, not -1 behind."""
    return max(0, version - engine_version)


def _staleness(status: Mapping[str, Any]) -> Panel:
    """Histogram of consumed groups by staleness (versions behind when trained on)."""
    hist = {int(k): int(v) for k, v in status.get("staleness_hist", {}).items()}
    info = learner_info(status)
    table = Table.grid(padding=(0, 1))
    table.add_column(justify="right")
    table.add_column()
    table.add_column(justify="right")
    peak = max(hist.values(), default=0)
    for staleness in range(max(hist, default=-1) + 1):
        count = hist.get(staleness, 0)
        table.add_row(str(staleness), Text(bar(count / peak if peak else 0, 24), "magenta"),
                      f"{count:,}")
    last = Text("nothing consumed yet" if not hist else
                f"last step: mean {fmt(info.get(STALENESS_MEAN), '.2f')} max "
                f"{fmt(info.get(STALENESS_MAX), '.0f')}", "dim")
    return Panel(Group(table, last), title=f"staleness of consumed groups (s ≤ "
                                           f"{status.get('max_staleness', '?')})",
                 title_align="left")


def _buffer(status: Mapping[str, Any]) -> Panel:
    depth, cap = status.get("depth", 0), status.get("max_groups") or 0
    uptime = status.get("uptime_s") or 0.0
    closed = status.get("gate_closed_s", 0.0)
    rejected = status.get("rejected", {})
    lines = [
        Text.assemble("depth    ", (bar(depth / cap if cap else 0, 20), "blue"),
                      f" {depth}/{cap or '?'}"),
        Text(f"accepted {status.get('accepted', 0):,}  consumed {status.get('consumed', 0):,}  "
             f"in flight {status.get('in_flight', 0)}"),
        Text(f"drops    stale {status.get('dropped_stale', 0):,}  rejected "
             f"{sum(rejected.values()):,}" + "".join(f"  {k} {v}" for k, v in rejected.items())),
        Text.assemble("gate     ", ("open", "green") if status.get("gate_open") else
                      ("CLOSED", "bold red"),
                      f"  closed {closed:.1f}s ({closed / uptime if uptime else 0:.0%} of "
                      f"uptime)"),
    ]
    if status.get("staleness_mode") == "pace":  # the learner's waits for old groups in flight
        paced = status.get("pace_held_s", 0.0)
        lines.append(Text(f"pace     learner held {paced:.1f}s "
                          f"({paced / uptime if uptime else 0:.0%} of uptime): waiting for "
                          f"groups that would go stale"))
    return Panel(Group(*lines), title="buffer", title_align="left")


@dataclass(frozen=True)
class TimeSplit:
    """A learner step's wall time (``timing/step``): ``parts``, disjoint intervals of the
    learner's main thread that add up to it (``other`` is the rest), and ``beside``, work
    that ran concurrently with them, shown next to them and never added in."""

    step: float | None
    parts: list[tuple[str, float | None]]      # in order; None: not in the record
    beside: list[tuple[str, float | None]] = field(default_factory=list)

    def share(self, seconds: float | None) -> float:
        """Of the step's wall time; the parts' shares sum to at most 1."""
        known = sum(v for _, v in self.parts if v)
        whole = max(self.step or 0.0, known)   # timers rounded past the step stay <= 100 %
        return seconds / whole if seconds is not None and whole else 0.0


def learner_time_split(info: Mapping[str, Any]) -> TimeSplit:
    """The learner's last step (its metrics record) as disjoint parts plus what overlapped.

    The learner's timers (``learners/loop.py``) are disjoint on its main thread: waiting for
    data, compute (the scatter and ``train_step`` inside it), the weight gather, and
    ``timing/weight_wait``, the time ``publish`` blocked on the previous delivery. The
    delivery itself (``timing/weight_sync``) runs on the publisher's thread with
    ``weights.overlap`` (the default): the record of step N carries version N-1's sync,
    which ran during step N beside its data wait and compute. Added to them it would count
    those seconds twice (a split past 100 %); what it cost the step is the wait. So it is
    shown beside the parts, marked, with its share of the step. Only a record
    whose sync is its own version's (``weights/version == step``: ``weights.overlap =
    false``) ran it inside the step, as a part. ``other`` is the rest of the step (ack,
    checkpoint, eval, heartbeat and metric writes); a record without ``weights/version``
    (the first step, older runs) is read as overlapped, the default."""
    step = info.get(STEP_TIME)
    sync = ("weight sync", info.get(WEIGHT_SYNC))
    synced = info.get("weights/version")
    serial = synced is not None and synced == info.get("step")
    parts = [("waiting for data", info.get(WAIT_DATA)), ("compute", info.get(COMPUTE)),
             ("weight gather", info.get(GATHER))]
    parts.append(sync if serial else ("waiting for sync", info.get(WEIGHT_WAIT)))
    if HANDOVER in info:   # launcher.colocate: engines to sleep and back, the state moved
        parts.append(("colocated handover", info.get(HANDOVER)))
    known = sum(v for _, v in parts if v)
    if step:
        parts.append(("other", max(0.0, step - known)))
    return TimeSplit(step, parts, [] if serial else [(f"{sync[0]} {OVERLAPPED}", sync[1])])


def _time_split(status: Mapping[str, Any], history: History) -> Panel:
    """The learner's last step: where its time went (:func:`learner_time_split`), and the
    idle ratios."""
    info = learner_info(status)
    split = learner_time_split(info)
    table = Table.grid(padding=(0, 1))
    table.add_column()
    table.add_column()
    table.add_column(justify="right")
    for (label, seconds), char in [*((p, BAR) for p in split.parts),
                                   *((p, BAR_BESIDE) for p in split.beside)]:
        share = split.share(seconds)
        table.add_row(label, Text(bar(share, 20, char), "yellow"),
                      "-" if seconds is None else f"{seconds:.3f}s {share:>4.0%}")
    lines: list[RenderableType] = [table]
    if split.beside:
        lines.append(Text(f"{OVERLAPPED} overlaps the parts above: not in their 100 %", "dim"))
    lines.append(Text(f"idle: learner {pct(learner_idle(info))} · engines "
                      f"{pct(fleet_idle(status, history))}"))
    if HANDOVER in info:
        lines.append(_handover(info))
    return Panel(Group(*lines), title=f"learner step {fmt(info.get('step'), 'd')} · "
                                      f"{fmt(split.step, '.3f')}s", title_align="left")


def _handover(info: Mapping[str, Any]) -> Text:
    """The colocated mode's last handover, move by move (``learners.colocate``): engines to
    sleep, the learner's state in, out, engines awake; on CUDA also the device memory each
    side held at its peak and what it kept while the other side ran."""
    text = (f"sleep {fmt(info.get('colocate/sleep_s'))} · in "
            f"{fmt(info.get('colocate/onload_s'))} · out "
            f"{fmt(info.get('colocate/offload_s'))} · wake "
            f"{fmt(info.get('colocate/wake_s'))} s")
    if "colocate/learner_gib_peak" in info:   # a line of its own: the panel is narrow
        text += (f"\npeak→kept GiB: learner {fmt(info.get('colocate/learner_gib_peak'), '.1f')}"
                 f"→{fmt(info.get('colocate/learner_gib_out'), '.2f')} · engines "
                 f"{fmt(info.get('colocate/engines_gib_peak'), '.1f')}→"
                 f"{fmt(info.get('colocate/engines_gib_asleep'), '.2f')}")
    return Text(text)


def _curves(status: Mapping[str, Any], history: History) -> Panel:
    info = learner_info(status)
    table = Table.grid(padding=(0, 1))
    table.add_column()
    table.add_column()
    table.add_column(justify="right")
    for label, name, key in (("reward", "reward", REWARD), ("|Δlogp|", "mismatch", MISMATCH),
                             ("learner idle", "learner_idle", None)):
        values = history.get(name)
        last = info.get(key) if key else learner_idle(info)
        table.add_row(label, Text(sparkline(values, 32), "cyan"), fmt(last))
    steps = f"steps {history.steps[0]}–{history.steps[-1]}" if history.steps else "no steps yet"
    return Panel(table, title=f"curves · {steps}", title_align="left")
