"""Start a vLLM server that ``rollout.engine = "vllm-server"`` can attach to.

    python -m rollouters.engines.vllm_launch MODEL_DIR --port 8000 [--device cpu|cuda|auto]
                                             [--weights-transport auto|gloo|nccl|ipc]
                                             [-- any other vllm api_server flag]

The server needs flags of ours (the RL routes, the gloo weight-transfer backend, the worker
extension: :func:`rollouters.engines.vllm_server.server_args`), ``VLLM_SERVER_DEV_MODE=1``,
this repository on its ``PYTHONPATH``, and on CPU the settings vLLM's CPU backend needs for a
small model (fp32, eager, a KV cache sized in bytes, not as a fraction of a GPU). Writing them
by hand failed for users, so this module is the one command the docs give, and the tests start
their servers with it: the documented command is the tested one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollouters.engines import vllm_weight_backend
from rollouters.engines.vllm_options import CPU_KV_CACHE_MB, VLLMOptions, sleep_frees_memory
from rollouters.engines.vllm_options import kv_cache_mb as kv_cache_size_mb

ROOT = Path(__file__).resolve().parents[2]  # the repository: the extension imports from it


def device_flags(device: str, kv_cache_mb: int = CPU_KV_CACHE_MB) -> list[str]:
    """What ``device`` needs beyond vLLM's defaults: nothing on CUDA (bf16, CUDA graphs and
    ``--gpu-memory-utilization`` are right there); on CPU fp32, eager mode and a KV cache in
    bytes (the GPU fraction means nothing on a host shared with the learner)."""
    if device == "cuda":
        return []
    return ["--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_cache_mb << 20)]


def command(model_dir: str, host: str, port: int, device: str,
            extra: Sequence[str] = (), kv_cache_mb: int = CPU_KV_CACHE_MB,
            weight_backend: str | None = None) -> list[str]:
    """The full ``python -m vllm.entrypoints.openai.api_server`` command line."""
    from rollouters.engines.vllm_server import server_args

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            *server_args(model_dir, host, port, weight_backend),
            *device_flags(device, kv_cache_mb), *extra]


def serving_flags(opts: VLLMOptions) -> list[str]:
    """``[rollout.vllm]``'s serving knobs as api_server flags, for the servers a worker starts
    itself (the device's own flags come from :func:`device_flags`); ``engine_args`` keys
    become ``--key-with-dashes`` flags (``--no-key`` for false, JSON for tables and lists)."""
    flags = ["--seed", str(opts.seed), "--max-num-seqs", str(opts.max_num_seqs),
             "--tensor-parallel-size", str(opts.tensor_parallel_size),
             "--data-parallel-size", str(opts.data_parallel_size),
             "--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.max_model_len is not None:
        flags += ["--max-model-len", str(opts.max_model_len)]
    if opts.device == "cuda" and opts.enforce_eager:
        flags.append("--enforce-eager")
    if sleep_frees_memory(opts):  # launcher.colocate on a GPU: its /sleep frees the memory
        flags.append("--enable-sleep-mode")
    if opts.routed_experts:  # learner.routing_replay (GPUs only: vllm_routing)
        flags.append("--enable-return-routed-experts")
    if opts.device == "cuda" and kv_cache_size_mb(opts):
        flags += ["--kv-cache-memory-bytes", str(kv_cache_size_mb(opts) << 20)]
    for key, value in opts.extra.items():
        flags += _flag(key, value)
    return flags


def _flag(key: str, value: Any) -> list[str]:
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else "--no-" + key.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [name, json.dumps(value)]
    return [name, str(value)]


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (the current environment) with the RL routes on and this repository
    importable by the server's workers."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollouters.engines.vllm_launch",
        description="Start a vLLM server for rollout.engine = \"vllm-server\" (one per rollout "
                    "worker; list their URLs in rollout.url). Flags after -- go to vLLM.")
    parser.add_argument("model_dir", help="the model directory: model.path, or for the tiny "
                        "model RUN_DIR/init_model (written by `asyncrl up` as it starts)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--kv-cache-mb", type=int, default=CPU_KV_CACHE_MB,
                        help="CPU only: the KV cache's size")
    parser.add_argument("--weights-transport", choices=["auto", "gloo", "nccl", "ipc"],
                        default="auto", help="the run's weights.transport (the server takes "
                        "weights the way it says)")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    device = _device(args.device)
    backend = vllm_weight_backend(args.weights_transport, device)
    argv_out = command(args.model_dir, args.host, args.port, device, extra, args.kv_cache_mb,
                       backend)
    os.execvpe(argv_out[0], argv_out, environment())


if __name__ == "__main__":
    main()
