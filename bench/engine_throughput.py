"""Torch engine throughput: generated tokens/s of ``TorchEngine.generate`` by batch size.

Why: the torch engine is the reference engine (tests, tiny-model runs, the fallback where vLLM
is absent), and the pipeline's generation:training ratio depends on how fast it generates. This
measures one ``generate`` call as a rollout worker makes it: sampled at temperature 1, KV cache,
HF ``past_key_values``, the engine's lock taken per decode step.

The model is a random-init Qwen2 built in code, by default the Qwen2-0.5B shape (hidden 896,
24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied: ~494M parameters), in bf16 on
CUDA and fp32 on CPU (``--dtype``); ``--small`` is a ~6M-parameter one for a CPU check. Every
prompt is ``--prompt-len`` random tokens and every row generates exactly ``--new-tokens``
tokens: EOS is an id outside the vocabulary, so a random model cannot stop a row early and all
batch sizes do the same work per row.

``--engine vllm`` compares the rollout engine on vLLM's ``AsyncLLM`` with vLLM run standalone
on the same model, prompts and sampling parameters, in the same run (:mod:`bench.vllm_throughput`).

For each ``--batch`` size: ``--warmup`` untimed calls, then ``--repeats`` timed ones (median
reported). A call with ``max_new_tokens = 1`` (the prefill and one sampled token) is timed the
same way, so ``decode ms/step`` = (call - prefill call) / (new tokens - 1). ``tokens/s`` counts
generated tokens only (batch x new tokens / call time). ``weights GB/s`` = the parameters' bytes
read once per decode step / decode step time: the floor of what a decode step must read, to
compare with the device's memory bandwidth (the KV cache's reads are extra and not counted).

    python bench/engine_throughput.py --device cpu --small     # CPU check
    python bench/engine_throughput.py --engine vllm --device cpu --small --batch 64
    python bench/engine_throughput.py --device cuda            # 0.5B shape, bf16
    python bench/engine_throughput.py --device cuda --batch 1 8 64 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.qwen_shapes import FULL, SMALL  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402

logger = logging.getLogger("bench.engine_throughput")

PAD_ID = 0


def build_model(shape: dict, max_positions: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Qwen2 of ``shape`` in ``dtype`` (seeded, so runs are comparable)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=max_positions, **shape)
    return Qwen2ForCausalLM(config).to(dtype)


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so the clock covers the work and not only its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one sampled ``generate`` call; checks that every row ran to the length."""
    sync(engine.device)
    start = time.perf_counter()
    out = engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=new_tokens)
    sync(engine.device)
    seconds = time.perf_counter() - start
    lengths = {len(c.tokens) for group in out for c in group}
    if lengths != {new_tokens}:
        raise RuntimeError(f"rows stopped early: lengths {sorted(lengths)} != {new_tokens}")
    return seconds


def measure(engine: TorchEngine, batch: int, args: argparse.Namespace, vocab: int,
            param_bytes: int) -> dict:
    """Median call and prefill times for one batch size, and the figures derived from them."""
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, vocab, (batch, args.prompt_len), generator=gen).tolist()
    for _ in range(args.warmup):
        timed_call(engine, prompts, args.new_tokens)
    calls, prefills = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        prefills.append(timed_call(engine, prompts, 1))
        calls.append(timed_call(engine, prompts, args.new_tokens))
    call, prefill = statistics.median(calls), statistics.median(prefills)
    step = max(call - prefill, 0.0) / max(args.new_tokens - 1, 1)
    row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "call_s": call, "calls_s": calls, "prefill_s": prefill,
           "tokens_per_s": batch * args.new_tokens / call,
           "decode_ms_per_step": 1e3 * step,
           "weights_gb_per_s": param_bytes / step / 1e9 if step > 0 else None}
    logger.info("batch %d: %.3f s per call, %.1f tokens/s", batch, call, row["tokens_per_s"])
    return row


def run(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = SMALL if args.small else FULL
    model = build_model(shape, args.prompt_len + args.new_tokens + 8, dtype)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # EOS outside the vocabulary: no row finishes early, every call does the same work.
    engine = TorchEngine(model, eos_ids=(shape["vocab_size"],), pad_id=PAD_ID, device=device,
                         seed=0)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
            "params": params, "param_bytes": param_bytes,
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    rows = [measure(engine, b, args, shape["vocab_size"], param_bytes) for b in args.batch]
    if device.type == "cuda":
        info["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return info, rows


def run_vllm(args: argparse.Namespace) -> None:
    """``--engine vllm``: ours against standalone vLLM (:mod:`bench.vllm_throughput`)."""
    import tempfile

    from bench.vllm_throughput import measure as measure_vllm
    from bench.vllm_throughput import report, save_model

    shape = SMALL if args.small else FULL
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    args.dtype = str(dtype).removeprefix("torch.")
    model = build_model(shape, args.prompt_len + args.new_tokens + 8, dtype)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        model_dir = save_model(model, Path(tmp))
        del model
        info, rows = measure_vllm(model_dir, shape["vocab_size"], args)
    report(info, rows)
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                        help="vllm: the rollout engine on AsyncLLM against standalone vLLM")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="~6M-parameter model for a CPU")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="rows per generate call (prompts x n)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the info and rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        run_vllm(args)
        return
    info, rows = run(args)
    print(f"{info['device']}, torch {info['torch']}, {info['dtype']}, "
          f"{info['params'] / 1e6:.1f}M params, attention {info['attn_implementation']}, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per row")
    print("| batch | call s | prefill s | decode ms/step | tokens/s | weights GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        gbs = f"{r['weights_gb_per_s']:.1f}" if r["weights_gb_per_s"] is not None else "n/a"
        print(f"| {r['batch']} | {r['call_s']:.3f} | {r['prefill_s']:.3f} | "
              f"{r['decode_ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {gbs} |")
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
