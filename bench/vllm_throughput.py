"""``engine_throughput.py --engine vllm``: the rollout engine against vLLM run standalone.

Both are vLLM's ``AsyncLLM`` on the same model directory, engine arguments, prompts and
``SamplingParams`` (temperature 1, ``logprobs=0`` as RL needs, no row stopping early): ours is
:class:`~rollouters.engines.vllm_async.AsyncVLLMEngine` as a rollout worker calls it
(``generate`` → Completions with per-token logprobs and versions; worker extension and the
weight-transfer backend loaded), standalone is a bare ``AsyncLLM`` driven from its own event
loop, one request per prompt, outputs only collected. Both engines are up at once and every
timed call alternates between them, so both see the same machine load; the whole is done
twice, each engine started first once (:func:`measure`).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch


class StandaloneVLLM:
    """A bare ``AsyncLLM`` (same engine arguments as ours, minus nothing vLLM needs)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        self.llm = asyncio.run_coroutine_threadsafe(start(), self._loop).result()
        self._calls = 0

    def generate(self, prompts: list[list[int]], params: Any) -> list[int]:
        """Generated tokens per row."""
        self._calls += 1

        async def one(i: int, prompt: list[int]) -> list[int]:
            final = None
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params,
                                               request_id=f"bench-{self._calls}-{i}"):
                final = out
            return [len(o.token_ids) for o in final.outputs]

        async def all_rows() -> list[list[int]]:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        rows = asyncio.run_coroutine_threadsafe(all_rows(), self._loop).result()
        return [n for row in rows for n in row]

    def close(self) -> None:
        async def shutdown() -> None:  # on the loop, where vLLM's output handler runs
            self.llm.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.llm = None  # freed now, not at interpreter exit (its __del__ shuts down again)


def save_model(model: torch.nn.Module, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def measure(model_dir: Path, vocab: int, args: Any) -> tuple[dict, list[dict]]:
    """Both start orders: the engine started first ran ~10 % slower in either role here (its
    worker's CPU binding, most likely), so each order is one session and the figure is the
    geometric mean of the two sessions' ratios."""
    from rollouters.engines.vllm_options import VLLMOptions, engine_kwargs

    # No stop token: no row finishes early, both engines do the same work.
    opts = VLLMOptions(eos_ids=(), dtype=args.dtype or "float32", device=args.device,
                       max_num_seqs=max(args.batch))
    bare = {k: v for k, v in engine_kwargs(model_dir, opts).items()
            if k not in ("worker_extension_cls", "weight_transfer_config")}
    rows = []
    for first in ("ours", "standalone"):
        rows += [dict(row, first=first) for row in _session(model_dir, opts, bare, first,
                                                            vocab, args)]
    for batch in args.batch:
        ratios = [r["ratio"] for r in rows if r["batch"] == batch]
        rows.append({"batch": batch, "first": "both", "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens,
                     "ratio": statistics.geometric_mean(ratios)})
    return {"device": args.device, "engine args": bare}, rows


def _session(model_dir: Path, opts: Any, bare: dict, first: str, vocab: int,
             args: Any) -> list[dict]:
    from rollouters.engines.vllm_async import AsyncVLLMEngine

    engines: dict[str, Any] = {}
    try:
        for name in (first, "standalone" if first == "ours" else "ours"):
            engines[name] = AsyncVLLMEngine(model_dir, opts) if name == "ours" \
                else StandaloneVLLM(bare)
        return [_measure_batch(engines["ours"], engines["standalone"], opts, batch, vocab,
                               args) for batch in args.batch]
    finally:
        for engine in engines.values():
            engine.close()


def _measure_batch(ours: Any, standalone: StandaloneVLLM, opts: Any, batch: int, vocab: int,
                   args: Any) -> dict:
    from rollouters.engines.vllm_options import sampling_params

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, vocab, (batch, args.prompt_len), generator=gen).tolist()
    params = sampling_params(opts, 1, 1.0, args.new_tokens, delta=False)

    def time_ours() -> float:
        start = time.perf_counter()
        out = ours.generate(prompts, n=1, temperature=1.0, max_new_tokens=args.new_tokens)
        seconds = time.perf_counter() - start
        assert {len(c.tokens) for g in out for c in g} == {args.new_tokens}
        return seconds

    def time_standalone() -> float:
        start = time.perf_counter()
        lengths = standalone.generate(prompts, params)
        seconds = time.perf_counter() - start
        assert set(lengths) == {args.new_tokens}
        return seconds

    for _ in range(args.warmup):
        time_ours()
        time_standalone()
    ours_s, bare_s = [], []
    for i in range(args.repeats):  # alternating, each first in turn
        pair = (time_ours, time_standalone) if i % 2 == 0 else (time_standalone, time_ours)
        for fn in pair:
            (ours_s if fn is time_ours else bare_s).append(fn())
    tokens = batch * args.new_tokens
    ours_tps, bare_tps = tokens / statistics.median(ours_s), tokens / statistics.median(bare_s)
    return {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "ours_s": ours_s, "standalone_s": bare_s, "ours_tokens_per_s": ours_tps,
            "standalone_tokens_per_s": bare_tps, "ratio": ours_tps / bare_tps}


def report(info: dict, rows: list[dict]) -> None:
    print(f"vLLM AsyncLLM, {info['device']}: rollout engine vs standalone, same prompts, "
          "model, engine args and sampling params")
    print("| batch | prompt | new tokens | started first | ours tokens/s | standalone tokens/s "
          "| ours/standalone |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ours = f"{r['ours_tokens_per_s']:.0f}" if "ours_tokens_per_s" in r else ""
        bare = f"{r['standalone_tokens_per_s']:.0f}" if "standalone_tokens_per_s" in r else ""
        print(f"| {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | {r['first']} | "
              f"{ours} | {bare} | {100 * r['ratio']:.1f} % |")
