"""LM-head memory and time of the log-prob path: chunked (fused) against the full logits.

The learner's logprob path takes the last hidden states ``[tokens, hidden]`` through the LM
head ``[vocab, hidden]`` to each token's logprob of its target and its entropy, then
backpropagates a loss on the logprobs into the hidden states and the head. The plain path
(``learner.logprob_chunk_tokens = 0``) holds the full ``[tokens, vocab]`` logits in fp32 and
several tensors of that size in its softmax and backward; the chunked one
(``learners.fused_logprobs``) holds one chunk's worth at a time.

The step is a forward and a backward of ``sum(logprob · g) + 0.01·sum(H)`` (the entropy
trained too, the costliest case). Memory: each variant runs one step in its own child process,
one after the other in the same run (a process's peak resident memory only grows, so
processes keep the figures apart); a child builds the inputs, takes its memory then as the
baseline (inputs, weights, the interpreter), and reports

- ``peak MiB``: the peak above that baseline (CPU: the peak resident set ``ru_maxrss``;
  CUDA: ``max_memory_allocated``), which includes the gradients of the head's weight and of
  the hidden states (the same size in both paths), and
- ``activ. MiB``: the peak less those gradients: the LM head's activation memory.

Time: then both variants in the parent process, interleaved step by step so that both see the
same machine load: ``s/step``, the median forward + backward, and ``no-grad s``, a forward
alone (the reference and proximal logprobs are computed without gradients).

    python bench/learner_memory.py                          # CPU: vocab 151936, hidden 896
    python bench/learner_memory.py --tokens 4096 --chunk 1024 --device cuda --dtype bfloat16
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def setup(args: argparse.Namespace):
    """The inputs of one variant, and its forward + backward and no-grad forward (timed)."""
    import torch
    import torch.nn.functional as F

    from learners.fused_logprobs import chunked_logprobs_entropy, plain_logprobs_entropy

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

    def logprobs(chunk: int):
        if chunk:
            return chunked_logprobs_entropy(hidden, weight, None, targets, chunk)
        return plain_logprobs_entropy(F.linear(hidden, weight), targets, entropy_grad=True)

    def step(chunk: int) -> float:
        start = time.perf_counter()
        lp, ent = logprobs(chunk)
        ((lp * g_logp).sum() + 0.01 * ent.sum()).backward()
        sync()
        hidden.grad = weight.grad = None
        return time.perf_counter() - start

    def no_grad(chunk: int) -> tuple[float, float, float]:
        start = time.perf_counter()
        with torch.no_grad():
            lp, ent = logprobs(chunk)
        sync()
        return (time.perf_counter() - start, float(lp.double().sum()),
                float(ent.double().sum()))

    grads_mib = (hidden.numel() + weight.numel()) * hidden.element_size() / 2**20
    return step, no_grad, grads_mib, sync


def child(args: argparse.Namespace) -> dict:
    """One variant's memory (``args.chunk`` tokens per chunk, 0 = full logits), alone in this
    process: the peak above the baseline during one forward + backward."""
    import torch

    step, _, grads_mib, sync = setup(args)
    cuda = args.device.startswith("cuda")
    sync()
    if cuda:
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mib()
    step(args.chunk)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mib()) - base
    return {"chunk": args.chunk, "peak_mib": peak, "activations_mib": peak - grads_mib}


def timings(args: argparse.Namespace) -> dict[str, dict]:
    """Both variants' times in THIS process, interleaved step by step (the same load)."""
    step, no_grad, _, _ = setup(args)
    out: dict[str, dict] = {"full": {"step_times": [], "no_grad_times": []},
                            "chunked": {"step_times": [], "no_grad_times": []}}
    for _ in range(args.steps):
        for name, chunk in (("full", 0), ("chunked", args.chunk)):
            out[name]["step_times"].append(step(chunk))
            took, lp_sum, ent_sum = no_grad(chunk)
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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for name, chunk in (("full", 0), ("chunked", args.chunk)):
        argv = [sys.executable, __file__, "--child", "--chunk", str(chunk)] + [
            f"--{k}={getattr(args, k)}" for k in ("tokens", "hidden", "vocab", "threads",
                                                  "device", "dtype")]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    for name, r in timings(args).items():
        results[name].update(r)
    full, chunked = results["full"], results["chunked"]
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, {args.dtype} on "
          f"{args.device}, {args.threads} thread(s), median of {args.steps} steps")
    print(f"{'path':<15}{'peak MiB':>9}{'activ. MiB':>11}{'s/step':>8}{'no-grad s':>10}")
    for name, r in results.items():
        label = "full logits" if name == "full" else f"chunks of {args.chunk}"
        print(f"{label:<15}{r['peak_mib']:>9.0f}{r['activations_mib']:>11.0f}"
              f"{r['step_s']:>8.2f}{r['no_grad_s']:>10.2f}")
    print(f"activations {full['activations_mib'] / max(chunked['activations_mib'], 1e-9):.1f}x "
          f"lower (peak {full['peak_mib'] / max(chunked['peak_mib'], 1e-9):.1f}x), step time "
          f"x{chunked['step_s'] / full['step_s']:.2f}, no-grad time "
          f"x{chunked['no_grad_s'] / full['no_grad_s']:.2f}; |Δ| of the logprob sum per token "
          f"{abs(full['logprob_sum'] - chunked['logprob_sum']) / args.tokens:.1e}, of the "
          f"entropy sum {abs(full['entropy_sum'] - chunked['entropy_sum']) / args.tokens:.1e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
