"""The live view: the buffer's ``status()`` drawn by :func:`asyncrl.dashboard.dashboard`.

``asyncrl monitor`` attaches to any running run and redraws the dashboard in place (rich
``Live``) on a terminal, or prints it once per refresh when its output is a file. ``asyncrl up``
shows the same dashboard on a terminal and one progress line per refresh otherwise (CI logs,
tests). ``asyncrl status`` prints it once; ``--json`` prints the raw status for scripts.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from collections.abc import Mapping
from typing import IO, Any, Protocol

from rich.console import Console
from rich.live import Live

from asyncrl.config.schema import MonitorConfig
from asyncrl.control_plane import STOPPED
from buffers.protocol import DATA_EXHAUSTED
from asyncrl.dashboard import dashboard, fmt
from asyncrl.snapshot import (MFU, REWARD, STALENESS_MAX, STALENESS_MEAN, TRAINED_TOKENS_PER_S,
                              History, evictions, learner_info, rollouts)
from asyncrl.metrics import val_score

SCREEN_WIDTH = 120  # when the output is not a terminal, render at a fixed width


def progress_line(status: dict[str, Any]) -> str:
    """One line: version, consumed staleness, token rates (and the learner's MFU where its
    device's peak is known), depth, score, held-out score, and the reward calls that failed
    (scored 0) once any did."""
    info = learner_info(status)
    gen = sum(m.get("info", {}).get("tokens_per_s", 0.0)
              for m in rollouts(status).values() if m.get("alive"))
    failed = info.get("reward/failed", 0)
    return (f"v{status.get('version', 0):<4} "
            f"stale mean {fmt(info.get(STALENESS_MEAN), '.2f')} "
            f"max {fmt(info.get(STALENESS_MAX), '.0f')} | "
            f"gen {gen:,.0f} tok/s train {fmt(info.get(TRAINED_TOKENS_PER_S), ',.0f')} tok/s" +
            (f" mfu {100 * info[MFU]:.1f}%" if MFU in info else "") + " | "
            f"depth {status.get('depth', 0)} drops {status.get('dropped_stale', 0)}" +
            (f" paced {status.get('pace_held_s', 0.0):.1f}s"
             if status.get("staleness_mode") == "pace" else "") + " | "
            f"score {fmt(info.get(REWARD))} val {fmt(val_score(info))}" +
            (f" | rewards failed {failed} of {failed + info.get('reward/ok', 0)}"
             if failed else ""))


class StatusView(Protocol):
    """Where successive status snapshots are shown."""

    def show(self, status: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class LiveView:
    """The dashboard redrawn in place on a terminal. While it is shown, prints and log
    records of this process go above it (rich's stdout/stderr proxies), not through it."""

    def __init__(self, out: IO[str], history: History) -> None:
        self.history = history
        self.live = Live(console=Console(file=out), auto_refresh=False,
                         vertical_overflow="ellipsis")
        original = sys.stderr
        self.live.start()  # on a terminal, sys.stdout and sys.stderr are now proxies
        self.rerouted = _reroute_log_handlers(original, sys.stderr)

    def show(self, status: dict[str, Any]) -> None:
        self.history.observe(status)
        self.live.update(dashboard(status, self.history), refresh=True)

    def close(self) -> None:
        self.live.stop()
        for handler, stream in self.rerouted:
            handler.setStream(stream)


def _reroute_log_handlers(old: IO[str], new: IO[str]) -> list[tuple[logging.StreamHandler,
                                                                     IO[str]]]:
    """Point the root logger's handlers that write to ``old`` (captured when logging was set
    up, so rich's redirection misses them) at ``new``; returns what to restore."""
    if new is old:
        return []
    handlers = [h for h in logging.getLogger().handlers
                if type(h) is logging.StreamHandler and h.stream in (old, sys.__stderr__)]
    return [(h, h.setStream(new)) for h in handlers]


class PrintView:
    """The dashboard printed once per refresh, as plain text (output to a file or pipe)."""

    def __init__(self, out: IO[str], history: History) -> None:
        self.history = history
        self.console = Console(file=out, width=SCREEN_WIDTH)

    def show(self, status: dict[str, Any]) -> None:
        self.history.observe(status)
        self.console.print(dashboard(status, self.history))
        self.console.file.flush()

    def close(self) -> None:
        self.console.file.flush()


def fleet_events(before: Mapping[str, str], status: Mapping[str, Any]
                 ) -> tuple[dict[str, str], list[str]]:
    """What changed in the rollout fleet since ``before`` (member -> state, from the last
    call): engines that joined, stopped, crashed (their supervisor's report, with its exit
    reason) or went silent past ``buffer.heartbeat_timeout_s``. A worker restarted by its role's
    supervisor shows up only in that role's log otherwise, and `asyncrl up`'s console is what
    a user watches. Returns the new states and one line per change."""
    states, events = {}, []
    for name, member in rollouts(status).items():
        info = member.get("info") or {}
        if info.get("state") == STOPPED:
            exit_ = info.get("exit")
            state = ("ran out" if exit_ == DATA_EXHAUSTED else
                     "crashed" if exit_ is not None else "stopped")
        else:
            state = "alive" if member.get("alive") else "silent"
        states[name] = state
        if before.get(name) == state:
            continue
        if state == "alive":
            events.append(f"{name} is back" if name in before else f"{name} joined")
        elif state == "crashed":
            events.append(f"{name} {info['exit']}: its role restarts it (log: logs/rollout.log)")
        elif state == "stopped":
            events.append(f"{name} stopped")
        elif state == "ran out":
            events.append(f"{name} stopped: its share of data.path ran out")
        elif state == "silent":
            events.append(f"{name} silent for {member.get('last_seen_s_ago', 0):.0f}s: let go")
    return states, events


def eviction_events(before: Mapping[str, str], status: Mapping[str, Any]
                    ) -> tuple[dict[str, str], list[str]]:
    """The engines the weight sync evicted since ``before`` (engine -> why, from the last
    call), from the learner's heartbeat: a frozen engine is still alive to the buffer, so
    :func:`fleet_events` does not see it go. Returns the evictions now and one line per new
    one."""
    now = evictions(status)
    return now, [f"evicted {name}: {why}" for name, why in now.items() if before.get(name) != why]


class LineView:
    """One progress line per refresh, and a line for each change in the rollout fleet and
    each engine evicted from the weight sync."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._fleet: dict[str, str] = {}  # `up` started the fleet: its first members are news
        self._evicted: dict[str, str] = {}

    def show(self, status: dict[str, Any]) -> None:
        self._fleet, events = fleet_events(self._fleet, status)
        for event in events:
            self.out.write(f"fleet: {event}\n")
        self._evicted, events = eviction_events(self._evicted, status)
        for event in events:
            self.out.write(f"weights: {event}\n")
        self.out.write(progress_line(status) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.flush()


def make_view(cfg: MonitorConfig, out: IO[str], run_dir: Path, lines: bool) -> StatusView:
    """``monitor.tui``: rich (live dashboard), plain, or auto (rich on a terminal). Off a
    terminal, ``lines`` picks progress lines (``up``) over printed dashboards (``monitor``).
    The sparklines start from the run's ``metrics.jsonl`` when this machine can read it."""
    live = cfg.tui == "rich" or (cfg.tui == "auto" and out.isatty())
    if not live and lines:
        return LineView(out)
    history = History.from_metrics(run_dir / "metrics.jsonl", cfg.history)
    return LiveView(out, history) if live else PrintView(out, history)


def print_status(status: dict[str, Any], cfg: MonitorConfig, run_dir: Path,
                 out: IO[str] = sys.stdout) -> None:
    """``asyncrl status``: the dashboard once, its curves from the run's ``metrics.jsonl``
    when this machine can read it."""
    history = History.from_metrics(run_dir / "metrics.jsonl", cfg.history)
    history.observe(status)
    Console(file=out, width=None if out.isatty() else SCREEN_WIDTH).print(
        dashboard(status, history))


def watch(client, view: StatusView, refresh_s: float, stop: threading.Event) -> None:
    """Show the run's status every ``refresh_s`` until stopped or the run is done."""
    try:
        while not stop.is_set():
            status = client.status()
            view.show(status)
            if status.get("run_status") == "done":
                return
            stop.wait(refresh_s)
    finally:
        view.close()
