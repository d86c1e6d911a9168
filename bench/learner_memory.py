"""LM-head memory and time of the log-prob path: chunked (fused) against the full logits.

The learner's logprob path takes the last hidden states ``[tokens, hidden]`` through the LM
head ``[vocab, hidden]`` to each token's logprob of its target and its entropy, then
backpropagates a loss on the logprobs into the hidden states and the head. The plain path
(``learner.logprob_chunk_tokens = 0``) holds the full ``[tokens, vocab]`` logits in fp32 and
several tensors of that size in its softmax and backward; the chunked one
(``learners.fused_logprobs``) holds one chunk's worth at a time.

The step is a forward and a backward of ``sum(logprob · g) + 0.01·sum(H)`` (the entropy
trained too, the costliest case). Memory: each variant runs in its own child process, one
after the other in the same run, so that no variant's freed memory counts for another; a
child builds the inputs, runs one untimed warm-up step (a compiled variant compiles there),
takes its memory then as the baseline (inputs, weights, the interpreter), and reports

- ``peak MiB``: the peak above that baseline during one more step (CPU: the peak resident
  set ``VmHWM``, reset through ``/proc/self/clear_refs`` at the baseline; CUDA:
  ``max_memory_allocated``), which includes the gradients of the head's weight and of the
  hidden states (the same size in both paths), and
- ``activ. MiB``: the peak less those gradients: the LM head's activation memory.

Time: then the variants in the parent process, interleaved step by step so that each sees the
same machine load: ``s/step``, the median forward + backward, and ``no-grad s``, a forward
alone (the reference and proximal logprobs are computed without gradients).

``--compile BACKEND`` adds a third variant: the same chunks with their softmax arithmetic
compiled (``learners.fused_logprobs.HeadKernels``, what ``learner.compile`` turns on). It
compiles in an untimed warm-up step in each process, so neither its time nor the compiler's
own memory is counted.

    python bench/learner_memory.py                          # CPU: vocab 151936, hidden 896
    python bench/learner_memory.py --tokens 4096 --chunk 1024 --device cuda --dtype bfloat16
    python bench/learner_memory.py --compile inductor       # + the compiled chunk arithmetic
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_mib() -> float:
    """This process's current resident set (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak_rss() -> None:
    """Start a new peak resident set (Linux: the ``VmHWM`` of :func:`_hwm_mib`)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def setup(args: argparse.Namespace):
    """The inputs of one variant, and its forward + backward and no-grad forward (timed)."""
    import torch
    import torch.nn.functional as F

    from learners.fused_logprobs import HeadKernels, chunked_logprobs_entropy, \
        plain_logprobs_entropy

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5
              ).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    g_logp = torch.randn(args.tokens, generator=g).to(device)
    hidden.requires_grad_()
    weight.requires_grad_()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    kernels = {False: HeadKernels(), True: HeadKernels(args.compile)} if args.compile \
        else {False: HeadKernels()}

    def logprobs(chunk: int, compiled: bool):
        if chunk:
            return chunked_logprobs_entropy(hidden, weight, None, targets, chunk,
                                            kernels[compiled])
        return plain_logprobs_entropy(F.linear(hidden, weight), targets, entropy_grad=True)

    def step(chunk: int, compiled: bool = False) -> float:
        start = time.perf_counter()
        lp, ent = logprobs(chunk, compiled)
        ((lp * g_logp).sum() + 0.01 * ent.sum()).backward()
        sync()
        hidden.grad = weight.grad = None
        return time.perf_counter() - start

    def no_grad(chunk: int, compiled: bool = False) -> tuple[float, float, float]:
        start = time.perf_counter()
        with torch.no_grad():
            lp, ent = logprobs(chunk, compiled)
        sync()
        return (time.perf_counter() - start, float(lp.double().sum()),
                float(ent.double().sum()))

    grads_mib = (hidden.numel() + weight.numel()) * hidden.element_size() / 2**20
    return step, no_grad, grads_mib, sync


def child(args: argparse.Namespace) -> dict:
    """One variant's memory (``args.chunk`` tokens per chunk, 0 = full logits; compiled with
    ``args.compile``), alone in this process: the peak above the baseline during one forward
    + backward, after an untimed warm-up step (which compiles a compiled variant)."""
    import torch

    step, no_grad, grads_mib, sync = setup(args)
    compiled = bool(args.compile)
    step(args.chunk, compiled)
    no_grad(args.chunk, compiled)
    cuda = args.device.startswith("cuda")
    sync()
    if cuda:
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mib()
        _reset_peak_rss()
    step(args.chunk, compiled)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else _hwm_mib()) - base
    return {"chunk": args.chunk, "peak_mib": peak, "activations_mib": peak - grads_mib}


def variants(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """``(name, chunk tokens, compiled)`` of each variant this run measures."""
    out = [("full", 0, False), ("chunked", args.chunk, False)]
    return out + ([("compiled", args.chunk, True)] if args.compile else [])


def timings(args: argparse.Namespace) -> dict[str, dict]:
    """The variants' times in THIS process, interleaved step by step (the same load)."""
    step, no_grad, _, _ = setup(args)
    out: dict[str, dict] = {name: {"step_times": [], "no_grad_times": []}
                            for name, _, _ in variants(args)}
    if args.compile:   # compiles, untimed
        step(args.chunk, True)
        no_grad(args.chunk, True)
    for _ in range(args.steps):
        for name, chunk, compiled in variants(args):
            out[name]["step_times"].append(step(chunk, compiled))
            took, lp_sum, ent_sum = no_grad(chunk, compiled)
            out[name]["no_grad_times"].append(took)
            out[name].update(logprob_sum=lp_sum, entropy_sum=ent_sum)
    for r in out.values():
        r["step_s"] = statistics.median(r["step_times"])
        r["no_grad_s"] = statistics.median(r["no_grad_times"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B's width")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's vocabulary")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk (chunked run)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", choices=["inductor", "aot_eager"],
                        help="also the chunks with their arithmetic compiled by this backend")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for name, chunk, compiled in variants(args):
        argv = [sys.executable, __file__, "--child", "--chunk", str(chunk)] + [
            f"--{k}={getattr(args, k)}" for k in ("tokens", "hidden", "vocab", "threads",
                                                  "device", "dtype")] + (
            ["--compile", args.compile] if compiled else [])
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    for name, r in timings(args).items():
        results[name].update(r)
    full, chunked = results["full"], results["chunked"]
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, {args.dtype} on "
          f"{args.device}, {args.threads} thread(s), median of {args.steps} steps")
    print(f"{'path':<15}{'peak MiB':>9}{'activ. MiB':>11}{'s/step':>8}{'no-grad s':>10}")
    labels = {"full": "full logits", "chunked": f"chunks of {args.chunk}",
              "compiled": f"+ {args.compile}"}
    for name, r in results.items():
        label = labels[name]
        print(f"{label:<15}{r['peak_mib']:>9.0f}{r['activations_mib']:>11.0f}"
              f"{r['step_s']:>8.2f}{r['no_grad_s']:>10.2f}")
    print(f"activations {full['activations_mib'] / max(chunked['activations_mib'], 1e-9):.1f}x "
          f"lower (peak {full['peak_mib'] / max(chunked['peak_mib'], 1e-9):.1f}x), step time "
          f"x{chunked['step_s'] / full['step_s']:.2f}, no-grad time "
          f"x{chunked['no_grad_s'] / full['no_grad_s']:.2f}; |Δ| of the logprob sum per token "
          f"{abs(full['logprob_sum'] - chunked['logprob_sum']) / args.tokens:.1e}, of the "
          f"entropy sum {abs(full['entropy_sum'] - chunked['entropy_sum']) / args.tokens:.1e}")
    if "compiled" in results:
        done = results["compiled"]
        print(f"compiled chunks: step time x{done['step_s'] / chunked['step_s']:.2f} and no-grad "
              f"x{done['no_grad_s'] / chunked['no_grad_s']:.2f} of the eager chunks', "
              f"activations x{done['activations_mib'] / max(chunked['activations_mib'], 1e-9):.2f};"
              f" |Δ| of the logprob sum per token against the full logits "
              f"{abs(full['logprob_sum'] - done['logprob_sum']) / args.tokens:.1e}")
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
