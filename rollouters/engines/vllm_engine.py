"""vLLM in-process engine (``rollout.engine = "vllm"``).

The engine is vLLM's ``LLMEngine`` with its core in this process (no engine-core subprocess),
driven one scheduler step at a time. That makes versioning exact and cheap: a step runs under
:attr:`VLLMEngine._lock`, so its tokens were produced by exactly the weights loaded when it ran,
and a weight update (:meth:`load_weights`, from the receiver thread) lands *between* two steps.
Pausing is therefore implicit: while the update holds the lock no step runs, the in-flight
requests stay scheduled with their KV cache, and generation resumes with the next step. This is
what vLLM's RL ``pause(mode="keep") → update → resume`` does, without its asynchronous output
path, where tokens computed before the pause can surface after the version bump.

Behaviour logprobs are vLLM's ``processed_logprobs`` (after temperature), like the learner's
recomputation. Prefix caching is off: a prefix cached under old weights must not be reused.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.vllm_extension import EXTENSION_CLS, pack_weights

logger = logging.getLogger(__name__)

# Smallest attention head size vLLM's CPU attention kernels support.
CPU_MIN_HEAD_DIM = 32


@dataclass
class VLLMOptions:
    """What the engine needs beyond the model directory (mapped from ``RolloutConfig``)."""

    eos_ids: tuple[int, ...]  # any of them ends a row (asyncrl.tokens)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    kv_cache_memory_mb: int = 64
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    max_num_seqs: int = 256
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Row:
    """One request's tokens as they arrive, tagged with the version of the step that made them."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def configure_process_env(device: str) -> None:
    """Environment vLLM reads at engine start; must run before the engine is built.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is required (the step-per-call design above); the
    others are CPU defaults a caller may override (the notes: without them a shared 2-core
    machine compiles for seconds and runs 20x slower).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def engine_args(model_dir: str | Path, opts: VLLMOptions) -> Any:
    """The ``EngineArgs`` for one rollout engine (token ids in and out, no tokenizer)."""
    from vllm import EngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model_dir), "dtype": opts.dtype, "seed": opts.seed,
        "enforce_eager": opts.enforce_eager, "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": False,
        "max_num_seqs": opts.max_num_seqs, "worker_extension_cls": EXTENSION_CLS,
        "gpu_memory_utilization": opts.gpu_memory_utilization}
    if opts.kv_cache_memory_mb > 0:
        kwargs["kv_cache_memory_bytes"] = opts.kv_cache_memory_mb << 20
    kwargs.update(opts.extra)
    return EngineArgs(**kwargs)


def check_head_dim(model_dir: str | Path, device: str) -> None:
    """Fail early and clearly where vLLM's CPU kernels would fail at the first batch."""
    if device != "cpu":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    if head_dim < CPU_MIN_HEAD_DIM:
        raise ValueError(
            f"vLLM on CPU needs an attention head size >= {CPU_MIN_HEAD_DIM}, the model has "
            f"{head_dim}: for the tiny model use model.tiny.hidden_size / num_heads >= 32 "
            "(e.g. --set model.tiny.num_heads=2 --set model.tiny.num_kv_heads=1)")


class VLLMEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over an in-process vLLM.

    ``on_step(step)`` (optional) is called after each scheduler step, outside the lock: a test
    hook to interleave weight loads deterministically, as in :class:`TorchEngine`.
    """

    def __init__(self, model_dir: str | Path, opts: VLLMOptions, version: int = 0,
                 on_step: Callable[[int], None] | None = None) -> None:
        check_head_dim(model_dir, opts.device)
        configure_process_env(opts.device)
        from vllm.v1.engine.llm_engine import LLMEngine

        self.eos_ids = tuple(opts.eos_ids)
        self.on_step = on_step
        self._version = version
        self._lock = threading.Lock()  # one scheduler step, or one weight update
        self._generate_lock = threading.Lock()  # one generate call owns the step loop
        self._ids = itertools.count()
        set_num_threads = torch.set_num_threads
        try:
            self._engine = LLMEngine.from_engine_args(engine_args(model_dir, opts),
                                                      enable_multiprocessing=False)
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op (it
            # assumes a process of its own); in-process, the rest of this process keeps control.
            torch.set_num_threads = set_num_threads
        logger.info("vLLM engine ready (%s, %s)", model_dir, opts.device)

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False) -> list[list[Completion]]:
        """``n`` completions per prompt; greedy takes the argmax and records logprobs at T=1."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy)
        params = self._sampling_params(0.0 if greedy else temperature, max_new_tokens)
        with self._generate_lock:
            rows = self._submit(prompts, n, params)
            try:
                self._run(rows)
            finally:
                self._abort_unfinished(rows)
        ordered = list(rows.values())
        completions = [self._completion(row) for row in ordered]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _sampling_params(self, temperature: float, max_new_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=1, temperature=temperature, max_tokens=max_new_tokens,
                              logprobs=0, stop_token_ids=list(self.eos_ids), ignore_eos=True,
                              detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    def _submit(self, prompts: list[list[int]], n: int, params: Any) -> dict[str, _Row]:
        """One request per sample (not vLLM's ``n``): each row is tracked by its own id."""
        call = next(self._ids)
        rows: dict[str, _Row] = {}
        with self._lock:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    request_id = f"asyncrl-{call}-{i}-{j}"
                    self._engine.add_request(request_id, {"prompt_token_ids": list(prompt)},
                                             params)
                    rows[request_id] = _Row()
        return rows

    def _run(self, rows: dict[str, _Row]) -> None:
        """Step until every row has finished; tag each step's tokens with its version."""
        pending = len(rows)
        for step in itertools.count():
            if pending == 0:
                return
            with self._lock:
                outputs = self._engine.step()
                version = self._version
            for output in outputs:
                pending -= self._record(rows[output.request_id], output, version)
            if self.on_step is not None:
                self.on_step(step)

    @staticmethod
    def _record(row: _Row, output: Any, version: int) -> int:
        """Append a delta output to its row; 1 if that finished the row."""
        sample = output.outputs[0]
        new_tokens = list(sample.token_ids)
        row.tokens.extend(new_tokens)
        row.logprobs.extend(step[tok].logprob for tok, step in zip(new_tokens, sample.logprobs))
        row.versions.extend([version] * len(new_tokens))
        if output.finished:
            row.finish_reason = "stop" if sample.finish_reason == "stop" else "length"
            return 1
        return 0

    def _abort_unfinished(self, rows: dict[str, _Row]) -> None:
        unfinished = [rid for rid, row in rows.items() if row.finish_reason is None]
        if unfinished:
            with self._lock:
                self._engine.abort_request(unfinished)

    def _completion(self, row: _Row) -> Completion:
        return Completion(tokens=row.tokens, logprobs=row.logprobs, versions=row.versions,
                          finish_reason=row.finish_reason or "length")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Reload named tensors between two scheduler steps, then set :attr:`version`.

        Serialising happens outside the lock, so generation only stops for the reload itself.
        """
        blob = pack_weights(weights)
        with self._lock:
            self._engine.collective_rpc("asyncrl_load_weights", args=(blob,))
            self._version = version
        logger.debug("vLLM engine loaded %d bytes of weights, version %d", len(blob), version)

    def weight(self, name: str) -> torch.Tensor:
        """A parameter as the running model holds it (tests: did an update land?)."""
        with self._lock:
            values = self._engine.collective_rpc("asyncrl_weight", args=(name,))[0]
        return torch.tensor(values)

    def close(self) -> None:
        """Shut the engine core down (frees the KV cache); the engine is unusable afterwards.

        In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vLLM also set up torch.distributed's
        default group and its own parallel groups in *this* process: release them too, or
        anything later in the process that starts a group (a learner, a test) finds one."""
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        with self._lock:
            self._engine.engine_core.shutdown()
            destroy_model_parallel()
            destroy_distributed_environment()
