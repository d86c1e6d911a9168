"""The monitor as a user sees it: the dashboard rendered to text from a real run's status.

``data/monitor_status.json`` is ``asyncrl status runs/quickstart/config.toml --json`` taken
from a real ``asyncrl up configs/quickstart.toml`` run at step 43, and
``data/monitor_metrics.jsonl`` that run's ``metrics.jsonl`` up to the same step. Record both
again the same way when metric names change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console

from asyncrl.dashboard import (OVERLAPPED, SPARK_CHARS, dashboard, learner_time_split,
                               sparkline)
from asyncrl.snapshot import (REWARD, STEP_TIME, History, engine_idle, fleet_idle,
                              learner_idle, learner_info)
from asyncrl.metrics import read_jsonl

DATA = Path(__file__).parent / "data"
WIDTH = 120


def snapshot() -> tuple[dict, History]:
    status = json.loads((DATA / "monitor_status.json").read_text())
    history = History(size=120)
    history.extend(read_jsonl(DATA / "monitor_metrics.jsonl"))
    history.observe(status)
    return status, history


def screen(status: dict, history: History | None = None, width: int = WIDTH) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))
    console.print(dashboard(status, history))
    return console.export_text()


def row(text: str, start: str) -> str:
    """The screen line holding a panel row that starts with ``start`` (left or right panel)."""
    return next(line for line in text.splitlines() if f"│ {start}" in line
                or line.strip("│ ").startswith(start))


def test_header_and_engine_table() -> None:
    status, history = snapshot()
    text = screen(status, history)
    version = status["version"]
    assert f"learner v{version}" in text.splitlines()[0]
    assert f"run {status['run_id']} · running" in text
    engines = {n: m for n, m in status["members"].items() if m["role"] == "rollout"}
    assert len(engines) == 2
    for name, member in engines.items():
        cells = row(text, name).strip("│ ").split()
        ev = member["info"]["engine_version"]
        assert cells[1:4] == ["yes", str(ev), str(version - ev)]  # alive, version, lag
        assert cells[4] == f"{member['info']['tokens_per_s']:,.0f}"
        assert cells[-3:-1] == [f"{member['last_seen_s_ago']:.1f}s", "ago"]
        assert cells[-1] == f"{engine_idle(member['info']):.0%}"


def test_the_header_shows_the_learners_mfu_where_it_has_one() -> None:
    """A CPU learner (the recorded run) reports no MFU; a GPU one's is in the header."""
    status, history = snapshot()
    assert "mfu" not in screen(status, history).splitlines()[0]
    learner = next(m for m in status["members"].values() if m["role"] == "learner")
    learner["info"]["perf/mfu"] = 0.2488
    assert "tok/s · mfu 24.9%" in screen(status, history).splitlines()[0]


def test_an_engine_ahead_of_the_published_version_shows_no_lag() -> None:
    """It acked the next weights, which are published once every engine has."""
    status, history = snapshot()
    name, member = next((n, m) for n, m in status["members"].items() if m["role"] == "rollout")
    member["info"]["engine_version"] = status["version"] + 1
    cells = row(screen(status, history), name).strip("│ ").split()
    assert cells[1:4] == ["yes", str(status["version"] + 1), "0"]


def test_an_engine_the_weight_sync_evicted_is_marked_and_the_reason_shown() -> None:
    """A frozen engine is still alive to the buffer; the learner's heartbeat says the weight
    sync evicted it, and why."""
    status, history = snapshot()
    name = next(n for n, m in status["members"].items() if m["role"] == "rollout")
    learner = next(m for m in status["members"].values() if m["role"] == "learner")
    why = "no heartbeat for 2.6 s during version 7 (frozen?)"
    learner["info"]["weights/evictions"] = {name: why}
    text = screen(status, history)
    assert row(text, name).strip("│ ").split()[1] == "evicted"
    assert f"weights: evicted {name}: {why}" in text


def test_staleness_histogram_bars_scale_with_counts() -> None:
    status, history = snapshot()
    text = screen(status, history)
    hist = {int(k): v for k, v in status["staleness_hist"].items()}
    assert len(hist) >= 2, hist  # a real async run trains on data of several ages
    peak = max(hist.values())
    for staleness, count in hist.items():
        drawn = re.search(rf"^│ {staleness} (█*) +([\d,]+) ", text, re.M)
        assert drawn is not None, text
        assert len(drawn.group(1)) == round(count / peak * 24) and drawn.group(2) == f"{count:,}"
    assert re.search(rf"^│ \d █{{24}} ", text, re.M)  # the tallest bar is full width


def test_idle_ratios_and_time_split() -> None:
    status, history = snapshot()
    text = screen(status, history)
    info = learner_info(status)
    expected = f"idle: learner {learner_idle(info):.0%} · engines {fleet_idle(status):.0%}"
    assert expected in text
    wait = row(text, "waiting for data")
    assert f"{info['timing/wait_data']:.3f}s" in wait
    assert f"{info['timing/compute']:.3f}s" in row(text, "compute")
    assert f"{info['timing/weight_sync']:.3f}s" in row(text, "weight sync")


SEQUENTIAL = ("waiting for data", "compute", "weight gather", "waiting for sync", "other")


def seconds_and_share(line: str) -> tuple[float, int]:
    found = re.search(r"([\d.]+)s +(\d+)% *│", line)
    assert found is not None, line
    return float(found.group(1)), int(found.group(2))


def set_timing(status: dict, synced: int, **seconds: float) -> None:
    """The snapshot's learner record with these ``timing/*`` seconds, its last weight
    delivery being version ``synced``'s."""
    info = learner_info(status)
    info.update({f"timing/{k}": v for k, v in seconds.items()},
                **{"weights/version": float(synced)})  # a float, as the learner writes it


def test_an_overlapped_weight_sync_is_shown_beside_the_step_not_added_to_it() -> None:
    """With weights.overlap the record of step N carries version N-1's sync, which ran during
    step N's data wait and compute (1.2 s of a 2 s step): the disjoint parts make 100 %, and
    the sync is shown beside them with its own share, marked as overlapping."""
    status, history = snapshot()
    step = learner_info(status)["step"]
    set_timing(status, step - 1, step=2.0, wait_data=0.2, compute=1.5, gather=0.1,
               weight_wait=0.1, weight_sync=1.2)
    text = screen(status, history)
    shares = {label: seconds_and_share(row(text, label)) for label in SEQUENTIAL}
    assert shares == {"waiting for data": (0.2, 10), "compute": (1.5, 75),
                      "weight gather": (0.1, 5), "waiting for sync": (0.1, 5),
                      "other": (0.1, 5)}
    assert sum(share for _, share in shares.values()) <= 100
    sync = row(text, "weight sync")
    assert f"weight sync {OVERLAPPED}" in sync and seconds_and_share(sync) == (1.2, 60)
    assert f"{OVERLAPPED} overlaps the parts above: not in their 100 %" in text
    split = learner_time_split(learner_info(status))
    assert abs(sum(split.share(s) for _, s in split.parts) - 1.0) < 1e-9


def test_a_serial_weight_sync_is_a_part_of_the_step() -> None:
    """weights.overlap = false: the record's sync is its own version's, run inside the step."""
    status, history = snapshot()
    step = learner_info(status)["step"]
    set_timing(status, step, step=2.0, wait_data=0.2, compute=1.0, gather=0.1,
               weight_wait=0.0, weight_sync=0.6)
    text = screen(status, history)
    labels = ("waiting for data", "compute", "weight gather", "weight sync", "other")
    shares = [seconds_and_share(row(text, label))[1] for label in labels]
    assert shares == [10, 50, 5, 30, 5] and OVERLAPPED not in text
    assert "waiting for sync" not in text  # nothing in flight to wait for: in "other"


def test_timers_past_the_step_never_make_more_than_100_percent() -> None:
    """Timers rounded to µs can add up to a hair over the step's wall time."""
    split = learner_time_split({"step": 3, STEP_TIME: 1.0, "timing/wait_data": 0.5,
                                "timing/compute": 0.6, "timing/gather": 0.0,
                                "timing/weight_wait": 0.0, "timing/weight_sync": 0.9})
    assert dict(split.parts)["other"] == 0.0
    assert sum(split.share(s) for _, s in split.parts) <= 1.0
    assert split.beside == [(f"weight sync {OVERLAPPED}", 0.9)]


def test_the_recorded_run_splits_its_step_into_at_most_100_percent() -> None:
    status, history = snapshot()
    text = screen(status, history)
    assert re.search(r"waiting for sync +- +│", text)  # the record predates weight_wait
    shares = [seconds_and_share(row(text, label))[1] for label in SEQUENTIAL
              if label != "waiting for sync"]
    assert sum(shares) <= 100
    assert OVERLAPPED in row(text, "weight sync")


def test_sparklines_draw_the_history() -> None:
    status, history = snapshot()
    text = screen(status, history)
    rewards = history.get("reward")
    assert len(rewards) == learner_info(status)["step"]  # every step from 1, none twice
    line = sparkline(rewards, 32)
    assert len(line) == 32 and set(line) <= set(SPARK_CHARS) and len(set(line)) >= 3
    assert line in row(text, "reward")
    assert f"{learner_info(status)[REWARD]:.3f}" in row(text, "reward")
    mismatch = row(text, "|Δlogp|")
    assert re.search(f"[{SPARK_CHARS}]{{10,}}", mismatch), mismatch
    assert f"steps {history.steps[0]}–{history.steps[-1]}" in text


def test_buffer_panel_and_drops() -> None:
    status, history = snapshot()
    text = screen(status, history)
    assert f"{status['depth']}/{status['max_groups']}" in text
    assert f"accepted {status['accepted']:,}  consumed {status['consumed']:,}" in text
    assert f"drops    stale {status['dropped_stale']:,}" in text
    assert f"closed {status['gate_closed_s']:.1f}s" in text


def test_before_the_first_step_nothing_is_made_up() -> None:
    text = screen({"version": 0, "run_status": "running", "members": {}})
    assert "learner v0" in text and "nothing consumed yet" in text and "no steps yet" in text
    assert "idle: learner - · engines -" in text


def test_history_keeps_each_step_once_and_at_most_size() -> None:
    history = History(size=3)
    for step in (1, 2, 2, 3, 4):
        history.add({"step": step, REWARD: step / 10})
    history.add({"step": "final"})
    assert list(history.steps) == [2, 3, 4] and history.get("reward") == [0.2, 0.3, 0.4]
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█" and sparkline([2.0, 2.0]) == "▁▁"


def test_history_follows_the_metrics_file_between_refreshes(tmp_path: Path) -> None:
    """Steps faster than the refresh: a heartbeat holds only the last one, so the steps in
    between come from metrics.jsonl; a torn last line is read once it is complete."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "critic/score/mean": 0.1}\n')
    history = History.from_metrics(path)
    with path.open("a") as f:
        f.write('{"step": 2, "critic/score/mean": 0.2}\n{"step": 3, "critic/sc')
    history.observe({"members": {"learner-0": {"role": "learner", "info": {
        "step": 4, REWARD: 0.4}}}})
    assert list(history.steps) == [1, 2, 4]  # 3 was torn when read, 4 came by heartbeat
    with path.open("a") as f:
        f.write('ore/mean": 0.3}\n{"step": 4, "critic/score/mean": 0.4}\n'
                '{"step": 5, "critic/score/mean": 0.5}\n')
    history.observe({"members": {}})
    assert list(history.steps) == [1, 2, 4, 5] and history.get("reward") == [0.1, 0.2, 0.4, 0.5]


def test_history_reads_a_metrics_file_again_once_records_were_set_aside(tmp_path: Path):
    """A learner that went on from step 3 moved the records of steps 4-5 aside (a new file):
    its own records of steps 4-5 are drawn. Before, steps 4-5 were already seen, and the new
    ones were skipped until step 6."""
    from asyncrl.metrics import set_aside_after

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "{REWARD}": 0.{s}}}\n' for s in range(1, 6)))
    history = History.from_metrics(path)
    assert list(history.steps) == [1, 2, 3, 4, 5]
    set_aside_after(path, 3)
    with path.open("a") as f:
        f.write(f'{{"step": 4, "{REWARD}": 0.9}}\n')
    history.follow()
    assert list(history.steps) == [1, 2, 3, 4] and history.get("reward") == [0.1, 0.2, 0.3, 0.9]


def test_engine_idle_is_recent_once_two_heartbeats_were_seen() -> None:
    """Over its life an engine was held 20 s of 100; since the last refresh, 9 s of 10."""
    status, _ = snapshot()
    history = History()
    history.observe(status)
    name, member = next((n, m) for n, m in status["members"].items() if m["role"] == "rollout")
    member["info"].update(gate_wait_s=20.0, generate_s=80.0)
    assert engine_idle(member["info"]) == 0.2
    history.observe(status)
    member["info"].update(gate_wait_s=29.0, generate_s=81.0)
    history.observe(status)
    history.observe(status)  # an unchanged heartbeat keeps the last window
    assert history.engine_window[name] == (9.0, 1.0)
    cells = row(screen(status, history), name).strip("│ ").split()
    assert cells[-1] == "90%"


def test_status_prints_the_dashboard_with_curves_from_the_run_dir(tmp_path: Path) -> None:
    import io
    import shutil

    from asyncrl.config.schema import MonitorConfig
    from asyncrl.monitor import print_status

    status, _ = snapshot()
    shutil.copy(DATA / "monitor_metrics.jsonl", tmp_path / "metrics.jsonl")
    out = io.StringIO()
    print_status(status, MonitorConfig(), tmp_path, out)
    assert "curves · steps 1–43" in out.getvalue()
    assert max(len(line) for line in out.getvalue().splitlines()) <= 120  # not a terminal


def test_pace_mode_shows_the_learners_wait_as_such() -> None:
    from asyncrl.monitor import progress_line

    status, history = snapshot()
    assert "pace" not in screen(status, history)          # drop mode: nothing to show
    paced = {**status, "staleness_mode": "pace", "pace_held_s": 12.5}
    assert re.search(r"pace\s+learner held 12\.5s", screen(paced, history))
    assert "paced 12.5s" in progress_line(paced)
