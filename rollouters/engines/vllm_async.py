"""vLLM as it runs on GPUs (``rollout.engine = "vllm"``, ``rollout.vllm.mode = "async"``).

The engine is vLLM's ``AsyncLLM``: its engine core runs in a process of its own, scheduling
overlapped with the forward, with CUDA graphs, tensor and data parallelism as vLLM provides
them. This module only drives it, from a private asyncio loop on one thread, so the
synchronous :class:`~rollouters.engines.base.Engine` protocol holds:

* ``generate``: one request per prompt with vLLM's ``n``, token ids in and out, behaviour
  logprobs as ``processed_logprobs``. Per-token versions are vLLM's own: each output carries
  the ``weight_version`` the engine core held when it sampled the tokens.
* ``load_weights``: vLLM's RL sequence only: ``pause_generation(mode="keep")`` (requests stay
  queued), ``start_weight_update``, ``update_weights`` while this process broadcasts the
  tensors on the transfer group (:class:`~rollouters.engines.vllm_sender.GroupSender`), or
  with handles of them (``weights.transport = "ipc"``: :mod:`vllm_ipc`; the engine core is
  another process, so it can map them), ``finish_weight_update(version)``,
  ``reset_prefix_cache`` (running requests are recomputed under the new weights, and no prefix
  cached under old weights is reused), ``resume``. Every call is bounded by
  ``update_timeout_s`` (``weights.timeout_s``).
* ``sleep`` / ``wake_up`` (``launcher.colocate``): vLLM's sleep mode, at level 1, with an
  update that arrives asleep held until the wake (:mod:`vllm_sleep` says why).
* routing replay (``learner.routing_replay``, GPUs only): vLLM returns each sample's routed
  experts, which become the completion's routing (:mod:`vllm_routing`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncrl.models import model_shapes
from asyncrl.weights.fit import check_fit
from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.vllm_options import (
    VLLMOptions,
    check_head_dim,
    completion,
    configure_process_env,
    engine_args,
    moves_vision,
    prepare_vlm,
    sampling_params,
    sent_weights,
    sleep_frees_memory,
    vllm_prompts,
)
from rollouters.engines.vllm_routing import layout_for, refusal_context
from rollouters.engines.vllm_sender import make_sender
from rollouters.engines.vllm_sleep import (
    SLEEP_LEVEL,
    HeldUpdate,
    SleepCycle,
    memory_report,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEAD_CHECK_S = 0.5
"""How often a wait on the engine looks whether its core died (:meth:`AsyncVLLMEngine._run`)."""


class AsyncVLLMEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over vLLM's ``AsyncLLM``."""

    def __init__(self, model_dir: str | Path, opts: VLLMOptions, version: int = 0,
                 update_timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        workers = opts.tensor_parallel_size * opts.data_parallel_size
        self._sender = make_sender(opts.weight_backend, host, workers, update_timeout_s)
        check_head_dim(model_dir, opts.device)
        self._routing = layout_for(model_dir, opts.routed_experts, opts.device)  # CPU: refused
        configure_process_env(opts.device, in_process=False,
                              tensor_parallel_size=opts.tensor_parallel_size)
        self._vision = prepare_vlm(model_dir)
        self._shapes = model_shapes(model_dir)  # what an update may carry (check_fit)
        self.opts = opts
        self.update_timeout_s = update_timeout_s
        self._version = version
        self._ids = itertools.count()
        self.cached_prompt_tokens = 0  # prompt tokens served from the prefix cache, so far
        self._update_lock = threading.Lock()  # one update, sleep or wake at a time
        self._sleep = SleepCycle(self._update_lock)  # the gate generate calls pass
        self._held = HeldUpdate()  # updates that arrived asleep, for the wake
        self._sizes: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async",
                                        daemon=True)
        self._thread.start()
        self._llm: Any = None
        try:
            self._llm = self._run(self._start(engine_args(model_dir, opts, asynchronous=True)))
        except ValueError as exc:
            self.close()
            if self._routing is None:
                raise
            raise refusal_context(exc) from exc
        except BaseException:
            self.close()
            raise
        self._sizes = self._run(self._llm.collective_rpc("asyncrl_memory"))[0]
        logger.info("vLLM AsyncLLM engine ready (%s, %s, version %d)", model_dir, opts.device,
                    version)

    async def _start(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(str(self._version))  # labels are ours from the start
        return llm

    async def _init_transfer(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the engine's loop and wait for it (``TimeoutError`` after
        ``timeout_s``, the coroutine then cancelled).

        A dead engine core fails the wait within :data:`DEAD_CHECK_S` with vLLM's
        ``EngineDeadError``: vLLM marks the client dead when its core process exits, but a
        utility call already sent (``pause_generation``, ``start_weight_update``, ...) is
        never answered, and an update waited for its whole ``weights.timeout_s`` (seen with a
        core SIGKILLed mid-update: 60 s instead of under one)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return future.result(DEAD_CHECK_S if left is None else min(DEAD_CHECK_S, left))
            except TimeoutError:
                if self._llm is not None and self._llm.errored:
                    future.cancel()
                    raise self._llm.dead_error from None
                if left is not None and left <= DEAD_CHECK_S:
                    future.cancel()
                    raise

    @property
    def version(self) -> int:
        return self._version

    # --- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False,
                 images: list[list[bytes]] | None = None) -> list[list[Completion]]:
        """As :meth:`VLLMEngine.generate <rollouters.engines.vllm_engine.VLLMEngine.generate>`,
        one request per prompt with vLLM's ``n``."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy, images)
        inputs = vllm_prompts(prompts, images, self._vision)
        params = sampling_params(self.opts, n, 0.0 if greedy else temperature, max_new_tokens,
                                 delta=False)
        call = next(self._ids)
        with self._sleep.gate.call():  # asleep: waits for the wake
            return self._run(self._generate_all(inputs, params, call,
                                                [len(p) for p in prompts]))

    async def _generate_all(self, prompts: list[dict[str, Any]], params: Any, call: int,
                            lengths: list[int]) -> list[list[Completion]]:
        """``lengths``: the prompts' in our ids (a VLM's with its pads expanded)."""
        ids = [f"asyncrl-{call}-{i}" for i in range(len(prompts))]
        tasks = [asyncio.ensure_future(self._generate_one(p, params, rid, length))
                 for p, rid, length in zip(prompts, ids, lengths)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await self._llm.abort(ids)
            raise

    async def _generate_one(self, prompt: dict[str, Any], params: Any, request_id: str,
                            prompt_length: int) -> list[Completion]:
        final = None
        async for output in self._llm.generate(dict(prompt), params, request_id=request_id):
            final = output
        assert final is not None and final.finished, request_id
        self.cached_prompt_tokens += final.num_cached_tokens or 0
        samples = sorted(final.outputs, key=lambda s: s.index)
        return [completion(sample, self._version, prompt_length, self._routing)
                for sample in samples]

    # --- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM's pause (keep) → start → update → finish(version) → reset prefix cache →
        resume. Tokens sampled before the pause keep their label, those after carry
        ``version``. Asleep, the update is held (copied) and applied at the wake."""
        weights = list(weights)
        check_fit(weights, self._shapes)  # vLLM loads tensor by tensor: refuse before the first
        stage = self._sender.stage_device  # host memory, or the GPU for ipc handles
        tensors = sent_weights([(name, t.detach().to(stage).contiguous())
                                for name, t in weights], self.opts)
        timeout = self.update_timeout_s
        with self._update_lock:
            if self._sleep.in_server:
                self._held.hold(tensors, version)
                return
            self._run(self._llm.pause_generation(mode="keep", clear_cache=False), timeout)
            try:
                self._apply(tensors, version)
            finally:
                self._run(self._llm.resume_generation(), timeout)
        logger.debug("vLLM AsyncLLM engine at version %d (%d tensors)", version, len(tensors))

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """start → update → finish(version) → reset prefix cache, generation paused; under
        the update lock."""
        timeout = self.update_timeout_s
        if not self._sender.joined:  # the first update, or the first after a failed one
            self._sender.join(lambda info: self._run(self._init_transfer(info)))
        self._run(self._llm.start_weight_update(), timeout)
        self._sender.send(tensors, lambda info: self._run(self._update(info)),
                          lambda: self._run(self._llm.finish_weight_update(str(version)),
                                            timeout))
        self._run(self._llm.reset_prefix_cache(reset_running_requests=True), timeout)
        if moves_vision(tensors):  # images' embeddings from the old tower
            self._run(self._llm.reset_encoder_cache(), timeout)
        self._version = version

    async def _update(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))

    # --- sleep and wake (launcher.colocate) ------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleep.asleep

    def sleep(self) -> None:
        """Let the generate calls in flight finish (new ones wait), then vLLM's
        ``sleep(level=1, mode="wait")``: it pauses its scheduler (nothing left to drain) and
        frees the device memory, weights to host (:mod:`vllm_sleep`)."""
        self._sleep.sleep(lambda: self._run(self._llm.sleep(level=SLEEP_LEVEL, mode="wait"),
                                            self.update_timeout_s))

    def wake_up(self) -> None:
        """vLLM's wake in its RL order, with the update held while asleep
        (:func:`~rollouters.engines.vllm_sleep.wake_in_order`); then the waiting generate
        calls go on."""
        timeout = self.update_timeout_s
        self._sleep.wake(lambda tags: self._run(self._llm.wake_up(tags=tags), timeout),
                         lambda: self._held.apply_with(self._apply))

    def memory(self) -> dict[str, int]:
        """The weights and KV cache on the device (0 asleep on a GPU), what waits in host
        memory; on CPU vLLM's sleep frees nothing, and the figures say so
        (:func:`~rollouters.engines.vllm_sleep.memory_report`)."""
        return memory_report(self._sizes, self._sleep.in_server, sleep_frees_memory(self.opts),
                             self._held.nbytes)

    def weight(self, name: str) -> torch.Tensor:
        """A parameter as the running model holds it (tests: did an update land?)."""
        values = self._run(self._llm.collective_rpc("asyncrl_weight", args=(name,)))[0]
        return torch.tensor(values)

    def close(self) -> None:
        """Shut the engine core down and stop the loop; idempotent. The shutdown runs on the
        loop, where vLLM's output handler task runs (cancelling it elsewhere is unsafe).

        The engine is forgotten before its shutdown is waited for: vLLM's shutdown marks its
        client dead first and then waits for the core processes, so :meth:`_run`'s dead-core
        check raised ``EngineDeadError`` from a shutdown that took over :data:`DEAD_CHECK_S`
        (seen with data parallelism: two engine cores and a coordinator to stop,
        tests/engines/test_vllm_tp.py)."""
        self._sender.drop()
        llm, self._llm = self._llm, None
        if llm is not None:
            self._run(_shutdown(llm))
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


async def _shutdown(llm: Any) -> None:
    llm.shutdown()
