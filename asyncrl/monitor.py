"""The live view: one screen built from the buffer's ``status()``, refreshed in place.

``asyncrl up`` prints the same figures as one progress line per refresh; ``asyncrl monitor``
attaches to any running run; ``asyncrl status --json`` prints the raw status once for scripts.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

CLEAR = "\x1b[H\x1b[2J"


def _learner_info(status: dict[str, Any]) -> dict[str, Any]:
    for member in status.get("members", {}).values():
        if member.get("role") == "learner" and "step" in member.get("info", {}):
            return member["info"]
    return {}


def _rollouts(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: m for name, m in sorted(status.get("members", {}).items())
            if m.get("role") == "rollout"}


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def progress_line(status: dict[str, Any]) -> str:
    """One line: version, consumed staleness, token rates, depth, reward, eval."""
    info = _learner_info(status)
    gen = sum(m.get("info", {}).get("tokens_per_s", 0.0)
              for m in _rollouts(status).values() if m.get("alive"))
    return (f"v{status.get('version', 0):<4} "
            f"stale mean {_fmt(info.get('learner/staleness_mean'), '.2f')} "
            f"max {_fmt(info.get('learner/staleness_max'), '.0f')} | "
            f"gen {gen:,.0f} tok/s train {_fmt(info.get('learner/tokens_per_s'), ',.0f')} tok/s | "
            f"depth {status.get('depth', 0)} drops {status.get('dropped_stale', 0)} | "
            f"reward {_fmt(info.get('learner/reward_mean'))} "
            f"eval {_fmt(info.get('eval/accuracy') or info.get('eval/last_accuracy'))}")


def render(status: dict[str, Any]) -> str:
    """The full monitor screen."""
    info = _learner_info(status)
    hist = status.get("staleness_hist", {})
    lines = [
        f"asyncrl · run {status.get('run_id', '?')} · {status.get('run_status', '?')} · "
        f"up {status.get('uptime_s', 0):.0f}s",
        progress_line(status),
        "",
        f"buffer  depth {status.get('depth', 0)}/{status.get('max_groups', '?')}  "
        f"accepted {status.get('accepted', 0)}  in flight {status.get('in_flight', 0)}  "
        f"consumed {status.get('consumed', 0)}  dropped stale {status.get('dropped_stale', 0)}  "
        f"rejected {sum(status.get('rejected', {}).values())}",
        f"gate    {'open' if status.get('gate_open') else 'CLOSED'}  "
        f"allowance {status.get('gate_allowance', '-')}  closed for "
        f"{status.get('gate_closed_s', 0.0):.1f}s  (s = {status.get('max_staleness')}, "
        f"groups/step = {status.get('groups_per_step')})",
        "staleness of consumed groups: " + (
            "  ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
            or "-"),
        f"learner step time: wait data {_fmt(info.get('learner/wait_data_s'))}s  "
        f"compute {_fmt(info.get('learner/compute_s'))}s  "
        f"weight sync {_fmt(info.get('weights/sync_s'))}s",
        "",
        f"{'engine':<24}{'alive':<7}{'version':>8}{'lag':>5}{'tok/s':>10}{'groups':>8}",
    ]
    version = status.get("version", 0)
    for name, member in _rollouts(status).items():
        m_info = member.get("info", {})
        ev = m_info.get("engine_version")
        lines.append(f"{name:<24}{'yes' if member.get('alive') else 'no':<7}"
                     f"{_fmt(ev, 'd'):>8}{_fmt(None if ev is None else version - ev, 'd'):>5}"
                     f"{m_info.get('tokens_per_s', 0.0):>10,.0f}{m_info.get('groups', 0):>8}")
    return "\n".join(lines)


def watch(client, refresh_s: float, stop: threading.Event, out=sys.stdout) -> None:
    """Redraw the screen every ``refresh_s`` until stopped or the run is done."""
    while not stop.is_set():
        status = client.status()
        out.write((CLEAR if out.isatty() else "") + render(status) + "\n")
        out.flush()
        if status.get("run_status") == "done":
            return
        stop.wait(refresh_s)
