"""vLLM in-process engine (``rollout.engine = "vllm"``, ``rollout.vllm.mode = "inprocess"``).

The engine is vLLM's ``LLMEngine`` with its core in this process (no engine-core subprocess),
driven one scheduler step at a time: the mode for small CPU machines, one process per engine
(:mod:`vllm_async` is vLLM as it runs on GPUs). A step runs under :attr:`VLLMEngine._lock`, and
a weight update (:meth:`load_weights`, from the receiver thread) takes the same lock, so it
lands *between* two steps: no step runs while it holds the lock, which is what vLLM's
``pause(mode="keep")`` does, and in-flight requests stay scheduled.

The update itself is vLLM's weight-transfer API, as in the async engine: start, update (this
process broadcasts on the ``asyncrl_gloo`` group to the worker, which is in this process too,
on another thread), finish with the version, reset the prefix cache. Per-token versions are
vLLM's ``weight_versions`` spans. Behaviour logprobs are ``processed_logprobs`` (after
temperature), like the learner's recomputation.

``sleep`` / ``wake_up`` (``launcher.colocate``) are the async engine's (:mod:`vllm_sleep`),
except that vLLM's in-process core refuses the pause mode ``"wait"``: the generate calls in
flight have finished before the sleep (the gate), and ``"keep"`` would lose nothing if not.

With ``learner.routing_replay`` (GPUs only) a row's last delta output carries the request's
routed experts, all of them, which become its routing (:mod:`vllm_routing`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.models import model_shapes
from asyncrl.weights.fit import check_fit
from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.vllm_gloo import BACKEND, NCCL_BACKEND
from rollouters.engines.vllm_ipc import IPC_BACKENDS
from rollouters.engines.vllm_options import (
    CPU_MIN_HEAD_DIM,
    VLLMOptions,
    check_head_dim,
    configure_process_env,
    engine_args,
    moves_vision,
    prepare_vlm,
    sampling_params,
    sent_weights,
    sleep_frees_memory,
    span_versions,
    vllm_prompts,
)
from rollouters.engines.vllm_routing import layout_for, refusal_context, to_routing
from rollouters.engines.vllm_sender import GroupSender
from rollouters.engines.vllm_sleep import (
    SLEEP_LEVEL,
    HeldUpdate,
    SleepCycle,
    memory_report,
)

__all__ = ["CPU_MIN_HEAD_DIM", "VLLMEngine", "VLLMOptions"]

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    """One request's tokens and logprobs as they arrive; versions come with its last output."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_length: int = 0
    routed: Any = None  # vLLM's routed experts, with the last output (learner.routing_replay)


def _refusal(backend: str) -> str:
    """Why the in-process engine refuses ``backend``: its worker runs in this process, on this
    process's GPU, and NCCL refuses two ranks on one device; a process cannot open its own
    CUDA IPC handle (``ipc``, and so its CPU stand-in ``asyncrl_shm`` too)."""
    if backend == NCCL_BACKEND:
        return ("weights.transport 'nccl': the in-process vLLM engine's worker shares this "
                "process's GPU, and NCCL refuses two ranks on one device (use 'gloo' or "
                "'auto', or rollout.vllm.mode = 'async' with the sender on a GPU of its own)")
    if backend in IPC_BACKENDS:
        return ("weights.transport 'ipc': the in-process vLLM engine's worker runs in this "
                "process, which cannot open its own CUDA IPC handles (use rollout.vllm.mode "
                "= 'async', or weights.transport = 'gloo' or 'auto')")
    return (f"weights.transport: the in-process vLLM engine sends weights with {BACKEND!r} "
            f"only, not {backend!r}")


class VLLMEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over an in-process vLLM.

    ``on_step(step)`` (optional) is called after each scheduler step, outside the lock: a test
    hook to interleave weight loads deterministically, as in :class:`TorchEngine`.
    """

    def __init__(self, model_dir: str | Path, opts: VLLMOptions, version: int = 0,
                 on_step: Callable[[int], None] | None = None,
                 update_timeout_s: float = 60.0) -> None:
        if opts.weight_backend != BACKEND:
            raise ValueError(_refusal(opts.weight_backend))
        check_head_dim(model_dir, opts.device)
        self._routing = layout_for(model_dir, opts.routed_experts, opts.device)  # CPU: refused
        configure_process_env(opts.device, in_process=True)
        self._vision = prepare_vlm(model_dir)
        self._shapes = model_shapes(model_dir)  # what an update may carry (check_fit)
        from vllm.v1.engine.llm_engine import LLMEngine

        self.opts = opts
        self.on_step = on_step
        self._version = version
        self._lock = threading.Lock()  # one scheduler step, or one weight update
        self._generate_lock = threading.Lock()  # one generate call owns the step loop
        self._ids = itertools.count()
        self._sleep = SleepCycle(self._lock)  # the gate generate calls pass, closed asleep
        self._held = HeldUpdate()  # updates that arrived asleep, for the wake
        set_num_threads = torch.set_num_threads
        try:
            self._engine = LLMEngine.from_engine_args(engine_args(model_dir, opts),
                                                      enable_multiprocessing=False)
        except ValueError as exc:
            if self._routing is None:
                raise
            raise refusal_context(exc) from exc
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op (it
            # assumes a process of its own); in-process, the rest of this process keeps control.
            torch.set_num_threads = set_num_threads
        # The OpenMP threads vLLM bound in this thread: its CPU attention builds its metadata
        # for that many and refuses a kernel run with another count ("Check failed:
        # input->metadata->thread_num == thread_num (2 vs. 1)"), which a generate call from a
        # thread of its own (OpenMP's default count there) would be.
        self._threads = torch.get_num_threads()
        self._engine.set_weight_version(str(version))  # labels are ours from the start
        self._sender = GroupSender("127.0.0.1", 1, update_timeout_s)
        self._sizes = self._engine.collective_rpc("asyncrl_memory")[0]
        logger.info("vLLM engine ready (%s, %s)", model_dir, opts.device)

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False,
                 images: list[list[bytes]] | None = None) -> list[list[Completion]]:
        """``n`` completions per prompt; greedy takes the argmax and records logprobs at T=1.
        ``images``: each prompt's encoded images, its ids already expanded (:func:`vllm_prompt`
        says how vLLM gets them)."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy, images)
        inputs = vllm_prompts(prompts, images, self._vision)
        params = sampling_params(self.opts, 1, 0.0 if greedy else temperature, max_new_tokens,
                                 delta=True)
        with self._sleep.gate.call(), self._generate_lock:  # asleep: waits for the wake
            if torch.get_num_threads() != self._threads:  # a caller's thread of its own
                torch.set_num_threads(self._threads)
            rows = self._submit(inputs, n, params, [len(p) for p in prompts])
            try:
                self._run(rows)
            finally:
                self._abort_unfinished(rows)
        ordered = list(rows.values())
        completions = [self._completion(row) for row in ordered]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _submit(self, prompts: list[dict[str, Any]], n: int, params: Any,
                lengths: list[int]) -> dict[str, _Row]:
        """One request per sample (not vLLM's ``n``): each row is tracked by its own id.
        ``lengths``: the prompts' lengths in our ids (a VLM's with its pads expanded)."""
        call = next(self._ids)
        rows: dict[str, _Row] = {}
        with self._lock:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    request_id = f"asyncrl-{call}-{i}-{j}"
                    self._engine.add_request(request_id, dict(prompt), params)
                    rows[request_id] = _Row(prompt_length=lengths[i])
        return rows

    def _run(self, rows: dict[str, _Row]) -> None:
        """Step until every row has finished; tag each step's tokens with its version."""
        pending = len(rows)
        for step in itertools.count():
            if pending == 0:
                return
            with self._lock:
                outputs = self._engine.step()
            for output in outputs:
                pending -= self._record(rows[output.request_id], output, self._version)
            if self.on_step is not None:
                self.on_step(step)

    @staticmethod
    def _record(row: _Row, output: Any, default_version: int) -> int:
        """Append a delta output to its row; 1 if that finished the row (its last output
        carries the version spans of all its tokens)."""
        sample = output.outputs[0]
        new_tokens = list(sample.token_ids)
        row.tokens.extend(new_tokens)
        row.logprobs.extend(step[tok].logprob for tok, step in zip(new_tokens, sample.logprobs))
        if output.finished:
            row.versions = span_versions(sample.weight_versions, len(row.tokens),
                                         default_version)
            row.finish_reason = "stop" if sample.finish_reason == "stop" else "length"
            row.routed = sample.routed_experts  # the whole request's, concatenated
            return 1
        return 0

    def _abort_unfinished(self, rows: dict[str, _Row]) -> None:
        unfinished = [rid for rid, row in rows.items() if row.finish_reason is None]
        if unfinished:
            with self._lock:
                self._engine.abort_request(unfinished)

    def _completion(self, row: _Row) -> Completion:
        routing = None if self._routing is None else \
            to_routing(row.routed, row.prompt_length, len(row.tokens), self._routing)
        return Completion(tokens=row.tokens, logprobs=row.logprobs, versions=row.versions,
                          finish_reason=row.finish_reason or "length", routing=routing)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM's start → update → finish(version) → prefix-cache reset, between two steps.

        Copies to CPU happen outside the lock, so generation only stops for the update. The
        reset preempts running rows: their KV cache is recomputed under the new weights. An
        update of a VLM's vision tower resets the encoder cache too (:func:`moves_vision`)."""
        weights = list(weights)
        check_fit(weights, self._shapes)  # vLLM loads tensor by tensor: refuse before the first
        tensors = sent_weights([(name, t.detach().to("cpu").contiguous())
                                for name, t in weights], self.opts)
        with self._lock:
            if self._sleep.in_server:  # held (copied) for the wake
                self._held.hold(tensors, version)
                return
            self._apply(tensors, version)
        logger.debug("vLLM engine loaded %d tensors, version %d", len(tensors), version)

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """start → update → finish(version) → reset prefix cache; under the lock."""
        rpc = self._engine.collective_rpc
        if not self._sender.joined:  # the first update, or the first after a failed one
            self._sender.join(lambda info: rpc("init_weight_transfer_engine",
                                               kwargs={"init_info": info}))
        rpc("start_weight_update")
        self._sender.send(tensors, lambda info: rpc("update_weights",
                                                    kwargs={"update_info": info}),
                          lambda: rpc("finish_weight_update"))
        self._engine.set_weight_version(str(version))
        self._engine.reset_prefix_cache(reset_running_requests=True)
        if moves_vision(tensors):  # images' embeddings from the old tower
            self._engine.reset_encoder_cache()
        self._version = version

    # --- sleep and wake (launcher.colocate) ------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleep.asleep

    def sleep(self) -> None:
        """Let the generate calls in flight finish (new ones wait), then vLLM's
        ``sleep(level=1)`` (:mod:`vllm_sleep`)."""
        self._sleep.sleep(lambda: self._engine.sleep(level=SLEEP_LEVEL, mode="keep"))

    def wake_up(self) -> None:
        """As the async engine's: vLLM's wake in its RL order with the held update
        (:func:`~rollouters.engines.vllm_sleep.wake_in_order`), then the waiting calls."""
        self._sleep.wake(lambda tags: self._engine.wake_up(tags=tags),
                         lambda: self._held.apply_with(self._apply))

    def memory(self) -> dict[str, int]:
        """As the async engine's (:func:`~rollouters.engines.vllm_sleep.memory_report`)."""
        return memory_report(self._sizes, self._sleep.in_server, sleep_frees_memory(self.opts),
                             self._held.nbytes)

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
            self._sender.drop()
            self._engine.engine_core.shutdown()
            destroy_model_parallel()
            destroy_distributed_environment()
