"""Async vs sync on the quickstart: wall time to held-out greedy accuracy 0.9.

Runs `asyncrl up configs/quickstart.toml` twice in one invocation, same seeds, changing only
``buffer.max_staleness`` (0 = synchronous on-policy, 2 = the quickstart's async setting), and
prints each run's wall time to the target and the ratio. Time is measured by the learner
(``time_s`` of the first eval record at or above the target), so process start-up is excluded
equally from both.

    python bench/async_vs_sync.py [--target 0.9] [--evals-every 5] [--repeats 1] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.metrics import read_jsonl, val_score  # noqa: E402


def run_once(staleness: int, seed: int, out: Path, args: argparse.Namespace) -> dict:
    name = f"s{staleness}-seed{seed}"
    cmd = [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "quickstart.toml"),
           "--set", f"run.output_dir={out}", "--set", f"run.name={name}",
           "--set", f"run.seed={seed}", "--set", f"buffer.max_staleness={staleness}",
           "--set", f"eval.every_steps={args.evals_every}",
           "--set", f"eval.stop_at_accuracy={args.target}",
           "--set", f"learner.total_steps={args.max_steps}"]
    for item in args.overrides:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    records = read_jsonl(out / name / "metrics.jsonl")
    hit = next((r for r in records if isinstance(r.get("step"), int)
                and (val_score(r) or -1) >= args.target), None)
    steps = [r for r in records if isinstance(r.get("step"), int)]
    return {"staleness": staleness, "seed": seed,
            "time_to_target_s": hit["time_s"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "steps": len(steps), "process_wall_s": round(wall, 1),
            "mean_step_s": round(steps[-1]["time_s"] / len(steps), 3) if steps else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--evals-every", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for staleness in (0, 2):
                result = run_once(staleness, seed, Path(tmp), args)
                print(result, flush=True)
                results.append(result)
    print(f"\n| max_staleness | seeds | time to acc {args.target} (s) | steps to target | "
          "mean step (s) |")
    print("|---|---|---|---|---|")
    medians = {}
    for staleness in (0, 2):
        rows = [r for r in results if r["staleness"] == staleness]
        times = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
        medians[staleness] = statistics.median(times) if len(times) == len(rows) else None
        print(f"| {staleness} | {len(rows)} | "
              f"{', '.join(str(r['time_to_target_s']) for r in rows)} | "
              f"{', '.join(str(r['steps_to_target']) for r in rows)} | "
              f"{', '.join(str(r['mean_step_s']) for r in rows)} |")
    if medians[0] and medians[2]:
        print(f"\nspeed-up (sync / async, median time to target): {medians[0] / medians[2]:.2f}x")
    else:
        print("\none of the settings did not reach the target: no ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
