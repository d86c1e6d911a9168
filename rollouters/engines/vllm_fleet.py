"""A vLLM server a rollout worker starts for itself (``rollout.engine = "vllm-server"`` with no
``rollout.url``): one per worker, as the SGLang engine does, so one config scales from one GPU
to a node of servers with tensor parallelism.

The server is started with the documented command (:mod:`vllm_launch`) plus
``[rollout.vllm]``'s serving knobs, and is ready once ``GET /health`` answers. It stays in the
worker's process group, so whoever kills the worker's group kills it too; :meth:`stop` ends it
with SIGTERM (vLLM's api_server then ends its engine-core processes), SIGKILL after a while.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from pathlib import Path

from rollouters.engines.http import request_json
from rollouters.engines.vllm_launch import ROOT, command, environment, serving_flags
from rollouters.engines.vllm_options import VLLMOptions, kv_cache_mb
from rollouters.engines.vllm_server import ServerError

logger = logging.getLogger(__name__)

POLL_S = 0.5  # between health probes of a starting server (a subprocess, not a thread)


class VLLMServer:
    """One launched ``vllm.entrypoints.openai.api_server`` process and its URL."""

    def __init__(self, model_dir: str | Path, opts: VLLMOptions, log_path: Path,
                 start_timeout_s: float = 600.0, host: str = "127.0.0.1",
                 extra_flags: tuple[str, ...] = ()) -> None:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        argv = command(str(model_dir), host, port, opts.device,
                       [*serving_flags(opts), *extra_flags], kv_cache_mb(opts))
        if opts.stop:  # stop strings need the tokenizer to detokenize
            argv.remove("--skip-tokenizer-init")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=environment(), cwd=ROOT)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("vLLM server %s started (pid %d)", self.url, self._proc.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise ServerError(f"vLLM server exited with {self._proc.returncode} before it "
                                  f"was ready; log: {self.log_path}")
            try:
                request_json("GET", self.url, "/health", None, 5.0, ServerError, ServerError)
                return
            except ServerError:
                if time.monotonic() > deadline:
                    raise ServerError(f"vLLM server {self.url} not ready within "
                                      f"{timeout_s:.0f}s; log: {self.log_path}") from None
                time.sleep(POLL_S)

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout_s``; idempotent."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._proc.poll() is not None:
                return
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM server pid %d ignored %s", self._proc.pid, sig.name)
