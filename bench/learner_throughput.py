"""Learner throughput: tokens/s of one FSDP2 ``train_step``, packed vs padded micro-batches.

One process, one rank (a world-1 gloo/NCCL group, the trainer the learner runs), a
random-init Qwen2-shaped model: by default the Qwen2-0.5B shape (hidden 896, 24 layers, 14
heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings: ~494M parameters); ``--small`` a
~5M-parameter one for a CPU. Every step trains the same synthetic RL batch: ``--groups``
groups of ``--group-size`` samples whose lengths spread like RL completions (prompt 16-64
tokens, completion 8 to ``--max-len`` tokens, uniform), token-level PPO-clip.

The learner's speed settings are flags: ``--attn`` (``model.attn_implementation``; default
``auto``, which logs its pick), ``--logprob-chunk-tokens`` (``learner.logprob_chunk_tokens``;
0 = the full logits), ``--compile`` (``learner.compile``, inductor), ``--liger``,
``--offload params``, ``--activation-checkpointing``; ``--best`` = ``--compile`` with the
defaults (auto attention, chunked logprobs) and packed micro-batches. ``--profile`` adds one
step per layout under ``torch.profiler`` (busy device time and the top ops, printed and in the
JSON), for finding where the MFU goes. ``--shape`` picks the
model: ``0.5b`` (default), ``1.5b`` (Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads,
MLP 8960, tied embeddings: ~1.54B parameters), ``small`` (= ``--small``).

Both micro-batch layouts run in the same process on the same batch, interleaved step by step
(packed, padded, packed, ...) so that both see the same machine load; ``ratio`` = padded
time / packed time. ``tokens/s`` counts real tokens (prompt + completion) per second of
``train_step``; padded micro-batches also compute their padding, reported as ``computed``.

MFU (CUDA only): the step's model FLOPs as the learner counts them for ``perf/mfu``
(``learners.flops``: 6 per parameter and token, the input embedding not counted, the LM head
on the trained tokens alone, which is all the learner runs it on, and causal attention's
``s²`` term) over the median step time and the device's dense bf16 peak (``--peak-tflops``,
else by the GPU's name: 989 TFLOP/s for H100/H200). Before 2026-11-28 the bench counted the
head on every token and no attention: 0.6 % fewer FLOPs for the 1.5B shape's batch. Also on
CUDA: ``peak GiB``, the most memory allocated during that layout's steps, which includes
both trainers' resident weights and AdamW state when both layouts run (``--layout`` one of
them to read a single trainer's need).

    python bench/learner_throughput.py --small              # CPU
    python bench/learner_throughput.py --layout padded --groups 2 --group-size 4 --max-len 256
                                                            # the 0.5B model on a 24 GiB CPU
    python bench/learner_throughput.py --device cuda        # GPU, bf16 (learner.mixed_precision)
    python bench/learner_throughput.py --device cuda --shape 1.5b --best --groups 16 \
        --max-len 1024 --micro-batch-tokens 16384                # issue 41's MFU goal
    python bench/learner_throughput.py --small --attn sdpa   # packing's old CPU penalty
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.schema import LearnerConfig  # noqa: E402
from asyncrl.net import free_port  # noqa: E402
from asyncrl.wire import TrajectoryGroup  # noqa: E402
from bench.qwen_shapes import FULL, SMALL  # noqa: E402
from learners.packing import LOGPROB_CHUNK_TOKENS  # noqa: E402
from learners.batching import collate  # noqa: E402
from learners.dist import init_learner_group, shutdown_learner_group  # noqa: E402
from learners.flops import peak_flops  # noqa: E402
from learners.packing import plan_micro_batches  # noqa: E402

logger = logging.getLogger("bench.learner_throughput")

# --layout: packing on/off. One layout halves the memory (one trainer and its AdamW state),
# which is what lets the 0.5B model train on a 24 GiB CPU machine.
LAYOUTS = {"both": (True, False), "packed": (True,), "padded": (False,)}
# Qwen2.5-1.5B's shape (its config.json): the size issue 41's MFU goal is stated at.
QWEN_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                 tie_word_embeddings=True)
SHAPES = {"small": SMALL, "0.5b": FULL, "1.5b": QWEN_1_5B}
ATTNS = ["auto", "sdpa", "flash_attention_2", "flex_attention", "eager", "varlen_sdpa"]


def build_model(shape: dict, max_len: int, path: Path) -> int:
    """Save a random-init Qwen2 of ``shape`` to ``path``; returns its FLOP-counted params."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=max_len + 64, **shape))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) - (
        0 if shape["tie_word_embeddings"] else model.model.embed_tokens.weight.numel())


def make_batch(groups: int, group_size: int, max_len: int, vocab: int, seed: int = 0):
    """A collated batch with RL-like length spread (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = int(rng.integers(16, 65))
        samples = []
        for _ in range(group_size):
            gen = int(rng.integers(8, max_len - prompt + 1))
            samples.append({"tokens": rng.integers(0, vocab, prompt + gen),
                            "reward": float(rng.random()),
                            # near a random-init model's own logprobs: no mismatch warnings
                            "logprobs": np.r_[np.zeros(prompt),
                                              np.full(gen, -float(np.log(vocab)))],
                            "loss_mask": np.r_[np.zeros(prompt), np.ones(gen)],
                            "versions": np.r_[-np.ones(prompt), np.zeros(gen)],
                            "finish_reason": "stop"})
        out.append(TrajectoryGroup.from_samples(f"g{g}", f"p{g}", samples))
    return collate(out, std_norm=True, pad_id=0)


def computed_tokens(lengths: list[int], budget: int, packing: bool) -> int:
    """Tokens the forward actually processes (padding included)."""
    plan = plan_micro_batches(lengths, budget, packing)
    if packing:
        return sum(lengths)
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)


def profile_step(trainer: Any, batch: Any, device: torch.device, top: int = 25) -> dict:
    """One more ``train_step`` under ``torch.profiler``: the wall time, the device time the
    kernels and copies took (``busy``: their sum, so overlapping streams can push it past the
    wall; on CPU the ops' own CPU time), and the ``top`` ops and kernels by their own device
    time (CPU: CPU time). Where the step's time goes while the MFU is below the goal."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    ranked = sorted(averages, key=lambda e: getattr(e, field, 0.0), reverse=True)
    # busy: the device's own events (kernels, copies), not the ops that launched them too
    own = [e for e in averages if not cuda or e.device_type != DeviceType.CPU]
    busy = sum(getattr(e, field, 0.0) for e in own) / 1e6
    return {"wall_s": wall, "busy_s": busy, "by": field,
            "top": [{"op": e.key[:120], "calls": e.count, "s": getattr(e, field, 0.0) / 1e6}
                    for e in ranked[:top]]}


def run(args: argparse.Namespace) -> list[dict]:
    from learners.backends.fsdp2 import Fsdp2Trainer

    shape = SHAPES[args.shape]
    device = init_learner_group(0, 1, master_port=free_port(), device=args.device)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            params = build_model(shape, args.max_len, Path(tmp))
            batch = make_batch(args.groups, args.group_size, args.max_len, shape["vocab_size"])
            lengths = batch.lengths.tolist()
            layouts = LAYOUTS[args.layout]
            trainers = {}
            for packing in layouts:
                cfg = LearnerConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                                    packing=packing,
                                    activation_checkpointing=args.activation_checkpointing,
                                    logprob_chunk_tokens=args.logprob_chunk_tokens,
                                    compile=args.compile, liger=args.liger,
                                    offload=args.offload)
                trainers[packing] = Fsdp2Trainer(tmp, cfg, device,
                                                 attn_implementation=args.attn)
            times: dict[bool, list[float]] = {packing: [] for packing in layouts}
            warmups: dict[bool, list[float]] = {packing: [] for packing in layouts}  # compiles
            peak_mem = {packing: 0 for packing in layouts}
            for step in range(args.warmup + args.steps):
                for packing, trainer in trainers.items():
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    trainer.train_step(batch)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        peak_mem[packing] = max(peak_mem[packing],
                                                torch.cuda.max_memory_allocated())
                    if step >= args.warmup:
                        times[packing].append(time.perf_counter() - start)
                    else:
                        warmups[packing].append(time.perf_counter() - start)
            profiles = {packing: profile_step(trainer, batch, device)
                        for packing, trainer in trainers.items()} if args.profile else {}
            peak = peak_flops(device, args.peak_tflops)
            tokens = sum(lengths)
            trained = int((batch.loss_mask != 0).sum())
            for packing in layouts:
                median = statistics.median(times[packing])
                row = {"layout": "packed" if packing else "padded", "params": params,
                       "shape": args.shape, "attn": trainers[packing].attn,
                       "logprob_chunk_tokens": args.logprob_chunk_tokens,
                       "compile": args.compile, "liger": args.liger, "offload": args.offload,
                       "sequences": len(lengths), "tokens": tokens, "trained_tokens": trained,
                       "computed_tokens": computed_tokens(lengths, args.micro_batch_tokens,
                                                          packing),
                       "micro_batches": len(plan_micro_batches(
                           lengths, args.micro_batch_tokens, packing)),
                       "step_s": median, "tokens_per_s": tokens / median,
                       "warmup_s": warmups[packing],
                       "ratio": (statistics.median(times[False]) / median
                                 if len(layouts) == 2 else None)}
                if peak is not None:
                    # the model FLOPs the learner itself reports (perf/mfu, learners.flops)
                    row["mfu"] = trainers[packing].steps.step_flops(batch) / median / peak
                    row["peak_tflops"] = peak / 1e12
                if device.type == "cuda":
                    row["peak_gib"] = peak_mem[packing] / 2**30
                if packing in profiles:
                    row["profile"] = profiles[packing]
                rows.append(row)
    finally:
        shutdown_learner_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="= --shape small (~5M params)")
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES),
                        help="Qwen2-0.5B, Qwen2.5-1.5B or a ~5M-parameter model")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layout", default="both", choices=sorted(LAYOUTS),
                        help="micro-batch layouts to time (both: interleaved, with the ratio)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--attn", default="auto", choices=ATTNS,
                        help="model.attn_implementation (auto logs its pick)")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=LOGPROB_CHUNK_TOKENS,
                        help="learner.logprob_chunk_tokens (0 = full logits)")
    parser.add_argument("--compile", action="store_true", help="learner.compile (inductor)")
    parser.add_argument("--liger", action="store_true", help="learner.liger (CUDA)")
    parser.add_argument("--offload", default="none", choices=["none", "params"],
                        help="learner.offload")
    parser.add_argument("--best", action="store_true",
                        help="--compile, packed micro-batches, default attention and logprobs")
    parser.add_argument("--peak-tflops", type=float, help="device peak for MFU")
    parser.add_argument("--profile", action="store_true",
                        help="one more step per layout under torch.profiler: busy time and "
                             "the top ops (in the JSON rows, and printed)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if args.small:
        args.shape = "small"
    if args.best:
        args.compile = True
        args.layout = "packed" if args.layout == "both" else args.layout
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("learners.attention").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"model params (FLOP-counted) {rows[0]['params'] / 1e6:.1f}M ({args.shape}), "
          f"{rows[0]['sequences']} sequences, {rows[0]['tokens']} tokens per step "
          f"({rows[0]['trained_tokens']} trained), "
          f"micro_batch_tokens {args.micro_batch_tokens}; attention {rows[0]['attn']}, "
          f"logprob chunks {args.logprob_chunk_tokens or 'off'}, compile {args.compile}, "
          f"liger {args.liger}, offload {args.offload}")
    print("| layout | micro-batches | computed tokens | step s | tokens/s | speed-up vs padded "
          "| MFU | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a (CPU)"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a (one layout)"
        mem = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "n/a"
        print(f"| {r['layout']} | {r['micro_batches']} | {r['computed_tokens']} | "
              f"{r['step_s']:.3f} | {r['tokens_per_s']:.1f} | {ratio} | {mfu} | {mem} |")
    for r in rows:
        if "profile" in r:
            prof = r["profile"]
            print(f"\n{r['layout']}: profiled step {prof['wall_s']:.3f} s, ops busy "
                  f"{prof['busy_s']:.3f} s ({prof['by']})")
            for op in prof["top"]:
                print(f"  {op['s']:8.4f} s  {op['calls']:6d}  {op['op']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
