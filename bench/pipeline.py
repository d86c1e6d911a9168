"""The pipeline at cluster scale, by simulation: async speedup against the pipeline bound.

Each scenario is a real ``asyncrl up`` of configs/sim.toml (64 simulated engines as threads of
one rollout process, 8 learner-rank processes with ``learner.backend = "sim"``, the ZMQ broker,
the real gate, learner loop and weight-sync protocol; only model compute is a calibrated wait).
Modes: synchronous (``max_staleness = 0``: generate the batch, wait for the slowest, train,
sync) and async with ``max_staleness`` 1, 2, 4, 8; with ``--pace`` each async ``s`` runs
again with ``buffer.staleness_mode = "pace"`` (no finished group dropped: the learner waits
instead). Sweeps the generation:training time ratio and the response-length tail.

Calibration, per (ratio, tail): ``T_gen`` = generate calls per step / engines × E[call time]
(E by Monte-Carlo of the engine's own timing model); ``T_train = T_gen / ratio``;
``T_sync = sync_frac · T_train``. Bounds per step:

- async: ``max(T_gen, T_train + T_sync)`` (the pipeline bound);
- sync: ``E[slowest engine's calls of a step] + T_train + T_sync``.

Measured over the steady state, from the learner's metrics: steps/s → samples/s and
tokens/s, learner idle (waiting for data / wall), engine idle (1 − generating / wall, from
heartbeats), staleness histogram of consumed groups, drops, gate-closed time per engine, and
the bias against long answers: the mean length of the samples trained on (the learner's
``response_length/mean``) against the mean length generated (the engine's own timing model,
as calibrated below: every generated sample, dropped or not). The
window starts once the start-up backlog has drained (:func:`window_start`); the run lasts a
planned warm-up (:meth:`Scale.warmup_steps`) plus ``steps``. Why there is a backlog: the
rollout fleet is up before the learner (its ranks take longer to start), so the gate's whole
window, s + 1 steps of groups at version 0, is generated before the first step; the learner
drains it without waiting for data, and the slow first weight sync (every engine joins)
leaves its tail staler than s. Measured from step 4 regardless of s and ratio, a run would
report that drain and its drops, not the steady state.

    python bench/pipeline.py                 # full sweep → bench/results/pipeline.{md,json,png}
    python bench/pipeline.py --quick         # one ratio, one tail, sync and s=2 (minutes)
    python bench/pipeline.py --tiny          # CI smoke scale: 4 engines, 1 rank, few steps
    python bench/pipeline.py --quick --pace  # s=2 dropping vs pacing, long tails
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.config.schema import SimConfig  # noqa: E402
from asyncrl.metrics import read_jsonl  # noqa: E402
from rollouters.engines.sim import sample_lengths, step_end_times  # noqa: E402

logger = logging.getLogger("bench.pipeline")

COLUMNS = ["tail", "ratio", "mode", "samples_per_s", "tokens_per_s", "speedup", "bound_speedup",
           "pct_of_bound", "learner_idle", "engine_idle", "staleness_hist", "drops",
           "gate_closed_s_per_engine", "step_s", "bound_step_s", "harness_cores", "machine_busy",
           "load_1min", "window", "len_trained", "len_generated"]


@dataclass
class Scale:
    """The cluster shape and run length of one sweep."""

    workers: int = 64
    ranks: int = 8
    groups_per_step: int = 64
    group_size: int = 8
    groups_per_batch: int = 1
    max_new_tokens: int = 512
    decode_step_s: float = 0.005
    mean_tokens: float = 64.0
    sigma: float = 1.0
    sync_frac: float = 0.02
    warmup: int = 4  # at least; see warmup_steps()
    steps: int = 16  # measured, after the warm-up

    def warmup_steps(self, staleness: int, ratio: float = 1.0) -> int:
        """Steps to leave out at the start of a run with ``max_staleness = staleness`` at a
        generation:training ratio ``ratio``: the planned warm-up, from which the run's length
        is set (:func:`window_start` then finds the actual start in the run's own metrics).

        The start-up backlog is s + 1 steps of groups. Where generation is the slower side
        (ratio > 1) the learner eats into it at 1/T_train while the fleet adds 1/T_gen, so it
        lasts (s + 1) / (1 - 1/ratio) steps: 18 at ratio 2, s = 8, not s + 3."""
        drain = staleness + 1
        if ratio > 1:
            drain = math.ceil((staleness + 1) / (1 - 1 / ratio))
        return max(self.warmup, drain + 2)


@dataclass
class Calibration:
    t_gen: float
    t_train: float
    t_sync: float
    tokens_per_step: float
    sync_gen: float  # E[slowest engine's generate time in one step] (the sync bound's part)

    def mean_length(self, scale: Scale) -> float:
        """Mean response length the engines generate, dropped samples included."""
        return self.tokens_per_step / (scale.groups_per_step * scale.group_size)

    @property
    def async_bound(self) -> float:
        return max(self.t_gen, self.t_train + self.t_sync)

    @property
    def sync_bound(self) -> float:
        return self.sync_gen + self.t_train + self.t_sync


@dataclass
class Row:
    tail: str
    ratio: float
    mode: str
    samples_per_s: float
    tokens_per_s: float
    speedup: float
    bound_speedup: float
    pct_of_bound: float
    learner_idle: float
    engine_idle: float
    staleness_hist: list[int] = field(default_factory=list)
    drops: int = 0
    gate_closed_s_per_engine: float = 0.0
    step_s: float = 0.0
    bound_step_s: float = 0.0
    harness_cores: float = 0.0  # CPU of the whole run (every role) / its wall time
    machine_busy: float = 0.0  # the machine's CPU busy fraction during the run (all users)
    load_1min: float = 0.0  # load average at the run's end (other users included)
    window: list[int] = field(default_factory=list)  # first and last step measured
    len_trained: float = 0.0  # mean response length of the samples trained on
    len_generated: float = 0.0  # mean response length generated (the engine's model)


def sim_config(scale: Scale, tail: str) -> SimConfig:
    return SimConfig(decode_step_s=scale.decode_step_s, mean_tokens=scale.mean_tokens,
                     length="uniform" if tail == "uniform" else "lognormal", sigma=scale.sigma)


def calibrate(scale: Scale, tail: str, ratio: float, samples: int = 40_000,
              seed: int = 0) -> Calibration:
    """Expected per-step times of the scenario from the engine's own timing model.

    ``samples`` generate calls: lognormal σ = 1 lengths have a coefficient of variation of
    1.3, so 400 calls (the default until 2026-11-24) put T_gen 3.9 % and the tokens per step
    2.5 % below their expectations (seed 0), and with them the bounds every run was compared
    to; 40,000 calls bring the standard error under 0.3 % (0.6 s per scenario)."""
    sim = sim_config(scale, tail)
    rng = np.random.default_rng(seed)
    batch = scale.groups_per_batch * scale.group_size
    calls_per_step = scale.groups_per_step / scale.groups_per_batch
    per_worker = math.ceil(calls_per_step / scale.workers)
    durations, tokens = [], []
    for _ in range(samples):
        lengths = sample_lengths(rng, sim, batch, scale.max_new_tokens)
        durations.append(step_end_times(sim, lengths)[-1])
        tokens.append(lengths.sum())
    durations_arr = np.array(durations)
    t_gen = calls_per_step / scale.workers * float(durations_arr.mean())
    # Synchronous: all engines start together; the step waits for the slowest one.
    slowest = []
    for _ in range(2000):
        picks = rng.choice(durations_arr, size=(scale.workers, per_worker))
        slowest.append(picks.sum(axis=1).max())
    t_train = t_gen / ratio
    return Calibration(t_gen=t_gen, t_train=t_train, t_sync=scale.sync_frac * t_train,
                       tokens_per_step=float(np.mean(tokens)) * calls_per_step,
                       sync_gen=float(np.mean(slowest)))


def overrides(scale: Scale, tail: str, ratio: float, cal: Calibration, staleness: int,
              mode: str = "drop") -> list[str]:
    sim = sim_config(scale, tail)
    params, param_bytes = 7e9, 2
    return [f"rollout.workers={scale.workers}", f"learner.ranks={scale.ranks}",
            f"learner.groups_per_step={scale.groups_per_step}",
            f"rollout.group_size={scale.group_size}",
            f"rollout.groups_per_batch={scale.groups_per_batch}",
            f"rollout.max_new_tokens={scale.max_new_tokens}",
            f"learner.total_steps={scale.warmup_steps(staleness, ratio) + scale.steps}",
            f"buffer.max_staleness={staleness}", f"buffer.staleness_mode={mode}",
            f"sim.decode_step_s={sim.decode_step_s}", f"sim.length={sim.length}",
            f"sim.mean_tokens={sim.mean_tokens}", f"sim.sigma={sim.sigma}",
            f"sim.train_token_s={cal.t_train / cal.tokens_per_step!r}",
            f"sim.model_params={params}", f"sim.param_bytes={param_bytes}",
            f"sim.sync_gb_per_s={params * param_bytes / cal.t_sync / 1e9!r}",
            # not measured: the final greedy eval (a few prompts) and the roles' stop (the
            # learner ends on its own; the fleet and broker are then stopped within 3 s)
            "task.eval_size=4", "launcher.stop_timeout_s=3"]


def run_scenario(config: Path, out: Path, name: str, sets: list[str], timeout_s: float
                 ) -> tuple[Path, dict[str, float]]:
    """One ``asyncrl up``; returns the run directory and what the run cost the machine: the
    simulated waits also wait for the CPU, so a harness (or a neighbour) that saturates it
    shows up as overhead."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "up", str(config),
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}"]
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               ASYNCRL_LOG_LEVEL=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"),
               PYTHONPATH=str(ROOT))
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    with log.open("w") as handle:
        with CpuMeter() as cpu:
            subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=handle,
                           stderr=subprocess.STDOUT, timeout=timeout_s)
    return out / name, cpu.result


class CpuMeter:
    """CPU used by the finished children (every role of the run: ``asyncrl up`` reaps them)
    and the machine's busy fraction, between enter and exit."""

    def __enter__(self) -> CpuMeter:
        self.start, self.machine = time.monotonic(), _machine_ticks()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu = usage.ru_utime + usage.ru_stime
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy, total = (b - a for a, b in zip(self.machine, _machine_ticks()))
        self.result = {"harness_cores": (usage.ru_utime + usage.ru_stime - self.cpu) / wall,
                       "machine_busy": busy / max(total, 1), "load_1min": os.getloadavg()[0]}


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def window_start(records: list[dict], warmup: int, tail_steps: int) -> int:
    """The first step of the steady state: at or after ``warmup``, the first step whose batch
    found no more groups queued than the run's last ``tail_steps`` steps ever did.

    The gate lets the fleet queue s + 1 steps of groups before the learner's first step;
    until that backlog is gone the learner never waits and steps faster than the pipeline
    can sustain. A fixed warm-up either cuts real steady state or keeps part of the drain
    (``lognormal, ratio 2, s=8`` read 124 % of the bound that way), so the run's own queue
    depth (``buffer/queued``, reported with each batch) says where the drain ended."""
    tail = [r.get("buffer/queued", 0) for r in records[-tail_steps:]]
    ceiling = max(tail) if tail else 0
    for r in records:
        if r["step"] >= warmup and r.get("buffer/queued", 0) <= ceiling:
            return int(r["step"])
    return warmup


def measure(run_dir: Path, scale: Scale, warmup: int) -> dict:
    """Throughput and idle ratios from the steady state's first step (:func:`window_start`,
    at least ``warmup``) to the last step of one run."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)]
    start = window_start(records, warmup, max(2, scale.steps // 2))
    window = [r for r in records if r["step"] >= start]
    if len(window) < 2:
        raise RuntimeError(f"{run_dir}: only {len(window)} steps after step {start}")
    if len(window) < scale.steps // 2 + 1:
        logger.warning("%s: the backlog drained late (step %d); %d steps measured", run_dir,
                       start, len(window) - 1)
    first, last = window[0], window[-1]
    span = last["time_s"] - first["time_s"]
    steps = last["step"] - first["step"]
    body = window[1:]  # the steps that end inside the span
    samples = steps * scale.groups_per_step * scale.group_size
    hist = np.sum([r.get("staleness/hist", [0]) for r in body], axis=0)
    wait = sum(r.get("timing/wait_data", 0.0) for r in body)
    generate = last.get("rollout/generate_s", 0.0) - first.get("rollout/generate_s", 0.0)
    gate = last.get("rollout/gate_wait_s", 0.0) - first.get("rollout/gate_wait_s", 0.0)
    return {"step_s": span / steps, "samples_per_s": samples / span,
            "tokens_per_s": sum(r["perf/trained_tokens"] for r in body) / span,
            "learner_idle": wait / span,
            "engine_idle": max(0.0, 1.0 - generate / (span * scale.workers)),
            "staleness_hist": [int(c) for c in hist.tolist()],
            # within the window, like every other column (the counter runs from the start)
            "drops": int(last.get("buffer/dropped_stale", 0)
                         - first.get("buffer/dropped_stale", 0)),
            "gate_closed_s_per_engine": gate / scale.workers,
            "len_trained": float(np.mean([r.get("response_length/mean", 0.0) for r in body])),
            "window": [int(first["step"]), int(last["step"])]}


def sweep(args: argparse.Namespace, scale: Scale, out: Path) -> list[Row]:
    rows: list[Row] = []
    modes = [(0, "drop")] + [(s, "drop") for s in args.staleness] + \
        ([(s, "pace") for s in args.staleness] if args.pace else [])
    for tail in args.tails:
        for ratio in args.ratios:
            cal = calibrate(scale, tail, ratio)
            logger.info("%s r=%g: T_gen %.3fs T_train %.3fs T_sync %.3fs; bounds: sync %.3fs "
                        "async %.3fs", tail, ratio, cal.t_gen, cal.t_train, cal.t_sync,
                        cal.sync_bound, cal.async_bound)
            sync_rate = None
            for staleness, mode in modes:
                name = f"{tail}-r{ratio:g}-s{staleness}" + ("-pace" if mode == "pace" else "")
                start = time.monotonic()
                run_dir, cost = run_scenario(args.config, out / "runs", name,
                                             overrides(scale, tail, ratio, cal, staleness, mode)
                                             + args.overrides, args.timeout)
                got = {**measure(run_dir, scale, scale.warmup_steps(staleness, ratio)), **cost}
                bound = cal.sync_bound if staleness == 0 else cal.async_bound
                rate = got["samples_per_s"]
                sync_rate = rate if staleness == 0 else sync_rate
                row = Row(tail=tail, ratio=ratio, mode="sync" if staleness == 0 else
                          f"async s={staleness}" + (" pace" if mode == "pace" else ""),
                          len_generated=cal.mean_length(scale),
                          speedup=rate / sync_rate if sync_rate else float("nan"),
                          bound_speedup=cal.sync_bound / bound,
                          pct_of_bound=bound / got["step_s"], bound_step_s=bound, **got)
                rows.append(row)
                write_results(rows, scale, out)  # a sweep cut short keeps what it measured
                logger.info("%s: %.1f samples/s, %.0f%% of bound, speedup %.2fx (bound %.2fx), "
                            "%.0fs", name, rate, 100 * row.pct_of_bound, row.speedup,
                            row.bound_speedup, time.monotonic() - start)
    return rows


def write_results(rows: list[Row], scale: Scale, out: Path) -> str:
    """``pipeline.md`` and ``pipeline.json`` in ``out``; returns the table."""
    table = to_markdown(rows)
    (out / "pipeline.md").write_text(table)
    (out / "pipeline.json").write_text(json.dumps(
        {"scale": asdict(scale), "rows": [asdict(r) for r in rows]}, indent=1))
    return table


def to_markdown(rows: list[Row]) -> str:
    head = ("| tail | T_gen:T_train | mode | samples/s | tokens/s | speedup vs sync | bound "
            "speedup | % of bound | learner idle | engine idle | staleness hist (0..s) | drops "
            "| gate closed s/engine | run CPU (cores) | machine busy | load | steps measured "
            "| mean length trained / generated |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.tail} | {r.ratio:g} | {r.mode} | {r.samples_per_s:.0f} | "
            f"{r.tokens_per_s:,.0f} | {r.speedup:.2f}× | {r.bound_speedup:.2f}× | "
            f"{100 * r.pct_of_bound:.0f} % | {100 * r.learner_idle:.0f} % | "
            f"{100 * r.engine_idle:.0f} % | {' '.join(map(str, r.staleness_hist))} | {r.drops} | "
            f"{r.gate_closed_s_per_engine:.1f} | {r.harness_cores:.2f} | "
            f"{100 * r.machine_busy:.0f} % | {r.load_1min:.1f} | "
            f"{'–'.join(map(str, r.window))} | {r.len_trained:.1f} / {r.len_generated:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, tail in zip(axes, ("uniform", "lognormal")):
        mine = [r for r in rows if r.tail == tail]
        if not mine:
            ax.set_visible(False)
            continue
        ratios = sorted({r.ratio for r in mine})
        for mode in dict.fromkeys(r.mode for r in mine if r.mode != "sync"):
            got = {r.ratio: r for r in mine if r.mode == mode}
            ax.plot(ratios, [got[x].speedup if x in got else np.nan for x in ratios], "o-",
                    label=mode)
        best = {x: max(r.bound_speedup for r in mine if r.ratio == x and r.mode != "sync")
                for x in ratios}
        ax.plot(ratios, [best[x] for x in ratios], "k--", label="bound")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ratios, [f"{x:g}" for x in ratios])
        ax.set_title(f"{tail} response lengths")
        ax.set_xlabel("generation : training time")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over synchronous")
    next(ax for ax in axes if ax.get_visible()).legend()
    fig.suptitle("asyncrl simulated: 64 engines, 8 learner ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "sim.toml")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1, 2, 4])
    parser.add_argument("--tails", nargs="+", default=["uniform", "lognormal"],
                        choices=["uniform", "lognormal"])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per run (after the warm-up)")
    parser.add_argument("--pace", action="store_true",
                        help="also run each async s with buffer.staleness_mode = pace")
    parser.add_argument("--quick", action="store_true", help="ratio 1, lognormal, sync and s=2")
    parser.add_argument("--tiny", action="store_true", help="4 engines, 1 rank (CI smoke)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    load_config(args.config)  # fail early on a bad config
    scale = Scale()
    if args.quick:
        args.ratios, args.tails, args.staleness = [1.0], ["lognormal"], [2]
    if args.tiny:
        scale = Scale(workers=4, ranks=1, groups_per_step=8, decode_step_s=0.002,
                      mean_tokens=16, max_new_tokens=128, warmup=2, steps=4)
    if args.steps:
        scale.steps = args.steps
    # The full sweep's results are kept in the repository (its run directories are ignored);
    # a quick or tiny run goes to a temporary directory unless --out says otherwise.
    out = args.out or (Path(tempfile.mkdtemp(prefix="asyncrl-pipeline-"))
                       if args.quick or args.tiny else ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep(args, scale, out)
    table = write_results(rows, scale, out)
    try:
        plot(rows, out / "pipeline.png")
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
    print(table)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

