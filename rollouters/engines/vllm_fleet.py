"""A vLLM server a rollout worker starts for itself (``rollout.engine = "vllm-server"`` with no
``rollout.url``): one per worker, as the SGLang engine does, so one config scales from one GPU
to a node of servers with tensor parallelism.

The server is started with the documented command (:mod:`vllm_launch`) plus
``[rollout.vllm]``'s serving knobs, and is ready once ``GET /health`` answers. Starting,
waiting and stopping are :class:`~rollouters.engines.managed_server.ManagedServer`'s: on
SIGTERM vLLM's api_server ends its engine-core processes, SIGKILL follows after a while.
"""

from __future__ import annotations

from pathlib import Path

from rollouters.engines.managed_server import ManagedServer, free_port
from rollouters.engines.vllm_launch import ROOT, command, environment, serving_flags
from rollouters.engines.vllm_options import VLLMOptions, cpu_thread_binding, kv_cache_mb
from rollouters.engines.vllm_server import ServerError

STOP_TIMEOUT_S = 20.0  # SIGTERM → SIGKILL: the engine core takes a while to end


class VLLMServer(ManagedServer):
    """One launched ``vllm.entrypoints.openai.api_server`` process and its URL, ready when
    constructed (a server that fails to start raises :class:`ServerError` and is stopped)."""

    def __init__(self, model_dir: str | Path, opts: VLLMOptions, log_path: Path,
                 start_timeout_s: float = 600.0, host: str = "127.0.0.1",
                 extra_flags: tuple[str, ...] = ()) -> None:
        port = free_port(host)
        argv = command(str(model_dir), host, port, opts.device,
                       [*serving_flags(opts), *extra_flags], kv_cache_mb(opts),
                       opts.weight_backend)
        if opts.stop:  # stop strings need the tokenizer to detokenize
            argv.remove("--skip-tokenizer-init")
        env = environment()
        env.update(cpu_thread_binding(opts.device, opts.tensor_parallel_size, env))
        super().__init__("vLLM server", argv, f"http://{host}:{port}", log_path,
                         env=env, cwd=ROOT, stop_timeout_s=STOP_TIMEOUT_S)
        self.wait_ready(start_timeout_s, "rollout.vllm.server_start_timeout_s", ServerError,
                        ServerError)
