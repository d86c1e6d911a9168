"""Inference engines behind one :class:`~rollouters.engines.base.Engine` protocol.

:func:`make_engine` is the only place that knows the engine kinds; the worker loop and the
workflows see just the protocol. Engine modules are imported lazily: vLLM is an optional
dependency and slow to import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config
    from rollouters.engines.base import Engine


def make_engine(cfg: Config, model_dir: str | Path, index: int) -> Engine:
    """The engine ``cfg.rollout.engine`` names, for rollout worker ``index``."""
    from asyncrl.models import EOS_ID, PAD_ID
    from learners.dist import resolve_device

    kind = cfg.rollout.engine
    seed = cfg.run.seed * 1000 + index
    if kind == "vllm-server":
        from rollouters.engines.vllm_server import VLLMServerEngine

        urls = [u.strip() for u in cfg.rollout.url.split(",") if u.strip()]
        if cfg.rollout.workers > len(urls):
            raise ValueError(f"rollout.workers ({cfg.rollout.workers}) > servers in rollout.url "
                             f"({len(urls)}): a server takes weights from one worker only")
        return VLLMServerEngine(urls[index], eos_id=EOS_ID,
                                timeout_s=cfg.rollout.request_timeout_s)
    device = str(resolve_device(cfg.rollout.device, index))
    if kind == "vllm":
        from rollouters.engines.vllm_engine import VLLMEngine, VLLMOptions

        r = cfg.rollout
        opts = VLLMOptions(eos_id=EOS_ID, dtype=cfg.model.dtype,
                           device="cpu" if device == "cpu" else "cuda", seed=seed,
                           kv_cache_memory_mb=r.kv_cache_memory_mb,
                           gpu_memory_utilization=r.gpu_memory_utilization,
                           enforce_eager=r.enforce_eager,
                           max_num_seqs=max(256, r.groups_per_batch * r.group_size))
        return VLLMEngine(model_dir, opts)
    if kind == "torch":
        from asyncrl.models import load_causal_lm
        from rollouters.engines.torch_engine import TorchEngine

        return TorchEngine(load_causal_lm(model_dir, cfg.model.dtype, device), eos_id=EOS_ID,
                           pad_id=PAD_ID, device=device, seed=seed)
    raise ValueError(f"unknown rollout.engine {kind!r}")
