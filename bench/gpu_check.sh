#!/usr/bin/env bash
# The prepared GPU check (issue 40): one script for the lent GPU machine (one H100 or H200,
# torch and transformers pre-installed, no vLLM, no package registry, at most 64 MiB carried).
# Every session lent a GPU runs it first and records its table in bench/RESULTS.md.
#
#   bash bench/gpu_check.sh [--out DIR] [--budget-s 540] [--only STEP,STEP...] [--dry-run]
#
# --only runs those steps (and env, which the report needs): a second call on the warm
# machine for the steps the first one had no time left for, e.g. --only learner_1p5b,learner_flex
#
# Steps in this order, each under its own `timeout` and all under --budget-s (default 540 s:
# with the machine's start the call stays under the device tool's 10 minutes; a step that no
# longer fits is skipped and says so). The first run (2026-11-28, H200) took 495 s.
#   env                   torch, CUDA, the GPU (nvidia-smi), and the matmul ceiling: bf16
#                         8192^3 TFLOP/s measured here (MFU is also stated against it)
#   ipc_transfer          bench/weight_sync.py --transport ipc, the Qwen2-0.5B shape in bf16,
#                         1 and 2 engines on the learner's GPU: time and GB/s of the sync
#                         against a raw cudaMemcpy (device-to-device copy_) of the same bytes
#   learner_mfu           bench/learner_throughput.py on CUDA, the Qwen2-0.5B shape, packed
#                         and padded interleaved with the default (auto) attention and
#                         chunked log-probs: tokens/s, MFU, peak GiB
#   learner_1p5b_best     the same at the Qwen2.5-1.5B shape with --best (learner.compile,
#                         packed): issue 41's MFU goal; --profile: one more step under
#                         torch.profiler, its busy device time and top ops (in the JSON)
#   colocated_quickstart  the quickstart (120 steps) with launcher.colocate = true on CUDA, if
#                         this tree's config has that key; otherwise skipped
#   gpu_tests             the gpu-marked tests of tests/unit and tests/integration (the ipc
#                         transport's among them) and vLLM ipc's CUDA handles
#                         (tests/engines/test_ipc_handles.py), if pytest is there
#   learner_1p5b          the 1.5B shape without compile, packed and padded (padded alone on
#                         a GPU under 100 GiB: both trainers took 87.8), if time is left
#   learner_flex          the 0.5B shape with model.attn_implementation = flex_attention,
#                         packed and padded (issue 41 asks for it), if time is left
#   learner_liger         the 1.5B shape, padded, with learner.liger (its wheel carried),
#                         if time is left
#   logprob_head          bench/learner_memory.py in bf16 at the 1.5B width, 16384 tokens:
#                         the LM head's log-prob path, full logits against chunks, eager and
#                         compiled (learner.compile), if time is left
# Writes three files to DIR: gpu_check.json, gpu_check.md (one table) and gpu_check_logs.tar.gz
# (the steps' logs, their raw JSON, the colocated run's metrics). The work itself happens in a
# temporary folder, because the device tool brings back only a few files from $OUT.
# DIR: --out, else $OUT (the device tool's), else ./gpu-check.
#
# Python: $PYTHON, else python3. The project's dependencies that the machine lacks come as
# wheels in ./wheels (ignored by git: the device tool's call must carry it, ~7 MB), installed
# with `pip install --no-index --no-deps --target` into the temporary folder; nothing is
# downloaded there. Prepare them where a registry is reachable with `make gpu-wheels` (for the
# GPU machine's Python, 3.12 so far; their dependencies come too). On the device tool:
#   run  command: bash bench/gpu_check.sh --out "$OUT"   carry: ["wheels"]   timeout_s: 600
#
# Without CUDA it refuses (exit 2) unless --dry-run, which checks on any machine that every
# step's Python pieces import, and writes the same JSON and table (nothing measured).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$PWD/gpu-check}"
BUDGET_S=540
DRY=0
ONLY=""
PY="${PYTHON:-python3}"

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR="$2"; shift 2 ;;
    --budget-s) BUDGET_S="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --only) ONLY=",$2,"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {print}' "$0"; exit 0 ;;
    *) echo "bench/gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

cd "$ROOT" || exit 2
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")" || exit 2
mkdir -p "$WORK/logs"
STEPS="$WORK/steps.tsv"
: > "$STEPS"
START=$(date +%s)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -d "$ROOT/wheels" ] && ls "$ROOT"/wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/pydeps" "$ROOT"/wheels/*.whl \
    > "$WORK/logs/wheels.log" 2>&1 || echo "bench/gpu_check.sh: wheels did not install ($WORK/logs/wheels.log)" >&2
  export PYTHONPATH="$PYTHONPATH:$WORK/pydeps"
fi

if [ "$DRY" = 0 ]; then
  torch_is="$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'torch ' + torch.__version__)" 2>&1 | tail -n 1)"
  if [ "$torch_is" != cuda ]; then
    echo "bench/gpu_check.sh: no CUDA device here ($torch_is): this check is for the GPU" \
         "machine; --dry-run checks its pieces on any machine" >&2
    exit 2
  fi
fi

REPORT_PY=$(cat <<'REPORT'
"""Assemble gpu_check.json and gpu_check.md from the steps and their JSON outputs."""
import json
import sys
from pathlib import Path

work, out, dry, total_s = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
quiet = sys.argv[5:] == ["quiet"]
LEARNER_STEPS = ("learner_mfu", "learner_1p5b_best", "learner_1p5b", "learner_flex",
                 "learner_liger")


def load(name):
    path = work / name
    return json.loads(path.read_text()) if path.exists() else None


steps = [dict(zip(("name", "status", "seconds", "detail"), line.split("\t", 3)))
         for line in (work / "steps.tsv").read_text().splitlines() if line]
runs = sorted((work / "runs").glob("**/metrics.jsonl")) if (work / "runs").exists() else []
records = [json.loads(line) for line in runs[-1].read_text().splitlines()
           if line.strip()] if runs else []
# the last training step's record (MFU, memory per phase), and the final eval's val/ scores
trained = next((r for r in reversed(records) if "timing/train_step" in r), {})
last = {**trained, **{k: v for k, v in (records[-1] if records else {}).items()
                      if k.startswith("val/")}} or None
report = {"dry_run": dry, "total_s": total_s, "env": load("env.json"), "steps": steps,
          "ipc_transfer": load("ipc_transfer.json"),
          **{name: load(f"{name}.json") for name in LEARNER_STEPS},
          "logprob_head": load("logprob_head.json"),
          "colocated_last_record": last}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2))

env = report["env"] or {}
matmul = env.get("matmul_tflops")
lines = [f"# GPU check{' (dry run)' if dry else ''}: {env.get('gpu', 'no GPU')}, "
         f"torch {env.get('torch')}, CUDA {env.get('cuda')}, {total_s} s; "
         f"bf16 matmul {matmul} TFLOP/s", "",
         "| step | status | s | result |", "|---|---|---|---|"]
results = {}
for row in report["ipc_transfer"] or []:
    results.setdefault("ipc_transfer", []).append(
        f"{row['engines']} engine(s), {row['mb']:.0f} MB: sync {row['sync_s']:.3f} s "
        f"{row['sync_gbs']:.1f} GB/s vs memcpy {row['raw_s']:.3f} s {row['raw_gbs']:.1f} GB/s "
        f"({row['ratio']:.0%})")
for name in LEARNER_STEPS:
    for row in report[name] or []:
        mfu = f"MFU {100 * row['mfu']:.1f} %" if "mfu" in row else "MFU n/a"
        if "mfu" in row and matmul:  # the same FLOPs against the ceiling measured here
            mfu += f" ({100 * row['mfu'] * row.get('peak_tflops', 989) / matmul:.1f} % of matmul)"
        results.setdefault(name, []).append(
            f"{row['layout']} ({row.get('attn', '?')}): {row['tokens_per_s']:,.0f} tokens/s, "
            f"{row['step_s']:.3f} s/step (first {row.get('warmup_s', [float('nan')])[0]:.1f} s), "
            f"{mfu}, peak {row.get('peak_gib', float('nan')):.1f} GiB"
            + (f"; profiled {row['profile']['wall_s']:.2f} s, kernels "
               f"{row['profile']['busy_s']:.2f} s, top: " + ", ".join(
                   f"{op['op'][:40]} {op['s']:.2f} s" for op in row["profile"]["top"][:3])
               if "profile" in row else ""))
for name, row in (report["logprob_head"] or {}).items():   # full, chunked, compiled
    results.setdefault("logprob_head", []).append(
        f"{name}: {row['step_s']:.3f} s/step, no-grad {row['no_grad_s']:.3f} s, "
        f"activations {row['activations_mib']:,.0f} MiB")
if report["colocated_last_record"]:  # the run's step, time, score and memory per phase
    record = report["colocated_last_record"]
    keys = [k for k in record if k in ("step", "time_s", "perf/mfu")
            or k.startswith(("val/", "colocate/")) or "gib" in k.lower()]
    results["colocated_quickstart"] = [", ".join(f"{k} {record[k]}" for k in keys)]
for s in steps:
    text = "; ".join(results.get(s["name"], [])) or s["detail"]
    lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {text} |")
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
if not quiet:
    print("\n".join(lines))
REPORT
)

# report [quiet]: gpu_check.json, gpu_check.md and the logs' tarball in DIR, from what the
# steps left so far. After every step too, so that a call cut short by the device tool's
# limit still brings back every finished step (the work folder itself stays there).
report() {
  "$PY" -c "$REPORT_PY" "$WORK" "$OUT_DIR" "$DRY" "$(( $(date +%s) - START ))" "$@"
  local rc=$?
  (cd "$WORK" && tar czf "$OUT_DIR/gpu_check_logs.tar.gz" --exclude=pydeps --exclude='*.pt' \
     --exclude='*.safetensors' --exclude='*.bin' --exclude='*.spill' .) \
    || echo "bench/gpu_check.sh: the logs were not packed ($WORK)" >&2
  return "$rc"
}

# record NAME STATUS SECONDS DETAIL
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"; }

# step NAME LIMIT_S COMMAND...: run it under `timeout` if it still fits the budget.
step() {
  local name="$1" limit="$2"; shift 2
  if [ -n "$ONLY" ] && [ "$name" != env ] && [ "$name" != pieces ] \
      && [[ "$ONLY" != *",$name,"* ]]; then
    return   # not asked for (--only)
  fi
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt "$limit" ]; then
    record "$name" skipped 0 "needs up to ${limit} s, ${left} s of the budget left"
    return
  fi
  local began=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$? took=$(( $(date +%s) - began ))
  case "$rc" in
    0) record "$name" ok "$took" "" ;;
    124|137) record "$name" timeout "$took" "over ${limit} s; see logs/$name.log" ;;
    *) record "$name" failed "$took" "exit $rc: $(tail -n 1 "$WORK/logs/$name.log" | tr '\t' ' ' | cut -c1-160)" ;;
  esac
  echo "gpu_check: $(tail -n 1 "$STEPS" | cut -f1-3 | tr '\t' ' ') s"   # progress, as it goes
  report quiet
}

has_pytest() { "$PY" -c "import pytest" 2>/dev/null; }
has_colocate() {
  "$PY" -c "import sys; from asyncrl.config.schema import LauncherConfig; sys.exit(0 if 'colocate' in LauncherConfig.model_fields else 1)" 2>/dev/null
}

ENV_PY='
import json, subprocess, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import transformers
    info["transformers"] = transformers.__version__
except ImportError:
    info["transformers"] = None
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                gpu_gib=round(props.total_memory / 2**30, 1))
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                         "--format=csv,noheader"], capture_output=True,
                                        text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    # the ceiling MFU is also stated against: bf16 8192^3, 3 warm-ups, mean of 10
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    info["matmul_tflops"] = round(2 * 8192**3 * 10 / (begin.elapsed_time(end) / 1e3) / 1e12, 1)
    del a, b
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(info)
'

PIECES_PY='
import importlib, sys
for name in ("tests.unit.test_weight_ipc", "tests.engines.test_ipc_handles",
             "asyncrl.weights.ipc", "asyncrl.weights.group",
             "bench.weight_sync", "bench.learner_throughput", "bench.learner_memory",
             "asyncrl.cli"):
    importlib.import_module(name)
    print("imports:", name)
'

if [ "$DRY" = 1 ]; then  # one process: the environment, and the pieces of every step import
  step pieces 120 "$PY" -c "$ENV_PY$PIECES_PY" "$WORK/env.json"
  if has_colocate; then
    record colocated_quickstart dry 0 "launcher.colocate is in the config: the run would start"
  else
    record colocated_quickstart skipped 0 "launcher.colocate is not in this tree's config"
  fi
  has_pytest || record pytest missing 0 "no pytest here: carry its wheels for gpu_tests"
else
  step env 60 "$PY" -c "$ENV_PY" "$WORK/env.json"
  # Both 1.5B trainers at once peaked at 87.8 GiB on the H200: on a smaller GPU (an H100's
  # 79 GiB) learner_1p5b times the padded layout alone
  GPU_GIB="$("$PY" -c "import json, sys; print(int(json.load(open(sys.argv[1])).get('gpu_gib', 0)))" \
             "$WORK/env.json" 2>/dev/null || echo 0)"
  LAYOUT_1P5B=both
  [ "$GPU_GIB" -ge 100 ] || LAYOUT_1P5B=padded
  step ipc_transfer 120 "$PY" bench/weight_sync.py --transport ipc --shape qwen2-0.5b \
    --dtype bfloat16 --engines 1 2 --bucket-mb 512 --rounds 3 --json "$WORK/ipc_transfer.json"
  LEARNER=(bench/learner_throughput.py --device cuda --groups 16 --max-len 1024
           --micro-batch-tokens 16384 --warmup 1 --steps 2)
  step learner_mfu 100 "$PY" "${LEARNER[@]}" --layout both --json "$WORK/learner_mfu.json"
  step learner_1p5b_best 150 "$PY" "${LEARNER[@]}" --shape 1.5b --best --profile \
    --json "$WORK/learner_1p5b_best.json"
  if has_colocate; then
    step colocated_quickstart 90 "$PY" -m asyncrl.cli up configs/quickstart.toml \
      --set launcher.colocate=true --set learner.device=cuda --set rollout.device=cuda \
      --set run.output_dir="$WORK/runs"
  else
    record colocated_quickstart skipped 0 "launcher.colocate is not in this tree's config"
  fi
  if has_pytest; then  # every gpu-marked test module of tests/unit and tests/integration,
    # and vLLM's ipc handles (tests/engines, but torch alone: no vLLM here)
    mapfile -t GPU_TESTS < <(grep -l "mark.gpu" tests/unit/*.py tests/integration/*.py \
                             tests/engines/test_ipc_handles.py)
    step gpu_tests 180 "$PY" -m pytest -q -rfEs --durations=20 -p no:cacheprovider -m gpu \
      "${GPU_TESTS[@]}"
  else
    record gpu_tests skipped 0 "pytest is not installed (carry its wheels in ./wheels)"
  fi
  step learner_1p5b 100 "$PY" "${LEARNER[@]}" --shape 1.5b --layout "$LAYOUT_1P5B" --profile \
    --json "$WORK/learner_1p5b.json"
  step learner_flex 120 "$PY" "${LEARNER[@]}" --layout both --attn flex_attention \
    --json "$WORK/learner_flex.json"
  step learner_liger 100 "$PY" "${LEARNER[@]}" --shape 1.5b --layout padded --liger \
    --json "$WORK/learner_liger.json"
  step logprob_head 180 "$PY" bench/learner_memory.py --device cuda --dtype bfloat16 \
    --tokens 16384 --chunk 1024 --hidden 1536 --steps 3 --compile inductor \
    --json "$WORK/logprob_head.json"
fi

report
status=$?
[ "$status" = 0 ] || exit "$status"
# exit status: 0 when every step that ran succeeded (skips are reported, not failures)
if cut -f2 "$STEPS" | grep -qE '^(failed|timeout)$'; then exit 1; fi
exit 0
