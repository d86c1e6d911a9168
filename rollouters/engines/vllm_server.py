"""An external vLLM server as an engine (``rollout.engine = "vllm-server"``, ``rollout.url``).

Someone else runs ``python -m vllm.entrypoints.openai.api_server`` (the flags the server needs
are in :func:`server_args`); a rollout worker attaches to it over HTTP:

* ``generate``: the token-in/token-out route ``/inference/v1/generate`` (``--enable-scale-out``),
  one request per prompt with ``n`` samples, sent concurrently. Its choices carry
  ``weight_versions``: spans of output tokens and the weight version the engine core held when
  it *sampled* them, so per-token versions are exact even for tokens delivered after an update.
* ``load_weights``: ``/pause?mode=keep`` (in-flight requests stay), ``/start_weight_update``,
  ``/update_weights`` while this process broadcasts the tensors on a gloo group
  (:mod:`vllm_gloo`), or with handles of them (``weights.transport = "ipc"``, a server on
  this worker's GPU: :mod:`vllm_ipc`), ``/finish_weight_update`` with the version,
  ``/reset_prefix_cache`` (prefix caching is on: nothing cached under old weights is reused;
  running rows are recomputed under the new ones), ``/resume``: the sequence the other vLLM
  engines run.
* routing replay (``learner.routing_replay``): a server started with
  ``--enable-return-routed-experts`` (a launched one is) returns each choice's
  ``routed_experts``, base64 of ``.npy`` bytes, converted as the other vLLM engines' are
  (:mod:`vllm_routing`); a server that returns none is an error naming the flag.
* ``sleep`` / ``wake_up`` (``launcher.colocate``): the server's ``/sleep?level=1&mode=wait`` and
  ``/wake_up?tags=weights``, the update held while asleep, ``/wake_up?tags=kv_cache``: the
  sequence of the in-process engines (:mod:`vllm_sleep`), over HTTP. The routes are vLLM's
  dev routes (``VLLM_SERVER_DEV_MODE=1``, as the RL routes); the memory is freed only by a
  server started with ``--enable-sleep-mode`` on a GPU (a launched one is, when it sleeps).

Only the standard library talks HTTP, so this engine adds no dependency. One worker per server:
the server holds one transfer group, joined at the first update.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.weights.fit import check_fit
from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.http import request_json
from rollouters.engines.vllm_options import parse_version, span_versions
from rollouters.engines.vllm_routing import RoutingLayout, decode_routed_experts, to_routing
from rollouters.engines.vllm_sleep import (
    SLEEP_LEVEL,
    HeldUpdate,
    SleepCycle,
    memory_report,
)

if TYPE_CHECKING:  # importing it imports vLLM: only a worker that sends needs it
    from rollouters.engines.vllm_sender import WeightSender

logger = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 16


def server_args(model_dir: str, host: str, port: int,
                weight_backend: str | None = None) -> list[str]:
    """The api_server flags an attached fleet needs (plus ``VLLM_SERVER_DEV_MODE=1`` in its env
    for the RL routes, and this repository on its ``PYTHONPATH`` for the extension);
    ``weight_backend``: the transfer backend's name (None: ``asyncrl_gloo``)."""
    from rollouters.engines.vllm_extension import EXTENSION_CLS
    from rollouters.engines.vllm_gloo import BACKEND

    return ["--model", model_dir, "--host", host, "--port", str(port),
            "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
            "--enable-prefix-caching", "--enable-scale-out",
            "--worker-extension-cls", EXTENSION_CLS,
            "--weight-transfer-config", json.dumps({"backend": weight_backend or BACKEND})]


class ServerError(RuntimeError):
    """The server answered with an error status, or not at all."""


class VLLMServerEngine:
    """Implements :class:`~rollouters.engines.base.Engine` against one vLLM server.

    ``eos_ids`` empty: no stop token, every row runs to ``max_new_tokens``. ``sampling``: more
    sampling parameters for every request (``top_p``, ``top_k``, ``stop``, ``stop_token_ids``
    besides the EOS ids). ``server``: one this worker launched (:mod:`vllm_fleet`), stopped by
    :meth:`close`. ``sleep_frees``: the server runs with ``--enable-sleep-mode`` on a GPU, so
    its sleep frees memory (only said in :meth:`memory`; an attached server's is not known
    here, and is reported as not freeing). ``weight_backend``: the transfer backend the server
    was started with (``asyncrl_gloo``, ``asyncrl_nccl``, ``asyncrl_ipc`` or ``asyncrl_shm``;
    None: ``asyncrl_gloo``). ``routing``: the model's layout, to return each position's
    experts (the server must run with ``--enable-return-routed-experts``); None: not asked for.
    ``shapes``: the model's tensor shapes (:func:`asyncrl.models.model_shapes`), which every
    update is checked against before anything is sent (:mod:`asyncrl.weights.fit`); None: the
    server's own refusal, which may leave the update partial.
    """

    def __init__(self, url: str, eos_ids: Sequence[int], timeout_s: float = 120.0,
                 host: str = "127.0.0.1", sampling: dict[str, Any] | None = None,
                 server: Any = None, sleep_frees: bool = False,
                 weight_backend: str | None = None,
                 routing: RoutingLayout | None = None,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.url = url.rstrip("/")
        self.eos_ids = tuple(eos_ids)  # the model's own (asyncrl.tokens), sent explicitly
        self.sampling = dict(sampling or {})
        self.timeout_s = timeout_s
        self._server = server
        self._host = host  # address the transfer group's store binds (the server dials it)
        self._update_lock = threading.Lock()  # one update, sleep or wake at a time
        self._weight_backend = weight_backend
        self._routing = routing
        self._shapes = shapes
        self._sender: WeightSender | None = None  # from the first update on
        self._sleep = SleepCycle(self._update_lock)  # the gate generate calls pass
        self._held = HeldUpdate()  # updates that arrived asleep, for the wake
        self._sleep_frees = sleep_frees
        self._sizes: dict[str, int] | None = None  # the worker's, asked at the first memory()
        self._version = parse_version(self._request("GET", "/weight_info")["weight_version"], 0)
        self._initial_version = self._version
        logger.info("attached to vLLM server %s at version %d", self.url, self._version)

    @property
    def version(self) -> int:
        return self._version

    # --- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False) -> list[list[Completion]]:
        """``n`` completions per prompt; greedy takes the argmax and records logprobs at T=1."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy)
        extra_stops = list(self.sampling.get("stop_token_ids", ()))
        params = {**self.sampling, "n": n, "temperature": 0.0 if greedy else temperature,
                  "max_tokens": max_new_tokens, "logprobs": 0,
                  "stop_token_ids": [*self.eos_ids, *extra_stops],
                  "ignore_eos": True,  # exactly these ids, every server
                  "detokenize": bool(self.sampling.get("stop"))}
        workers = min(len(prompts), MAX_CONCURRENT_REQUESTS)
        with self._sleep.gate.call(), \
                ThreadPoolExecutor(workers, thread_name_prefix="vllm-http") as pool:
            return list(pool.map(lambda p: self._generate_one(p, params), prompts))

    def _generate_one(self, prompt: list[int], params: dict[str, Any]) -> list[Completion]:
        body = {"token_ids": list(prompt), "sampling_params": params, "output_mode": "tokens",
                "stream": False}
        reply = self._request("POST", "/inference/v1/generate", body)
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return [self._completion(choice, len(prompt)) for choice in choices]

    def _completion(self, choice: dict[str, Any], prompt_length: int) -> Completion:
        tokens = list(choice["token_ids"])
        logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
        versions = span_versions(choice.get("weight_versions"), len(tokens),
                                 self._initial_version)
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(tokens=tokens, logprobs=logprobs, versions=versions,
                          finish_reason=reason, routing=self._routed(choice, prompt_length,
                                                                     len(tokens)))

    def _routed(self, choice: dict[str, Any], prompt_length: int, num_tokens: int) -> Any:
        """The choice's routing in our frame, when asked for."""
        if self._routing is None:
            return None
        routed = decode_routed_experts(choice.get("routed_experts"))
        if routed is None:
            raise ServerError(f"learner.routing_replay: the vLLM server {self.url} returned no "
                              "routed_experts (start it with --enable-return-routed-experts)")
        return to_routing(routed, prompt_length, num_tokens, self._routing)

    # --- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pause (requests kept), broadcast the tensors into the server, label them ``version``,
        reset the prefix cache, resume. Safe beside :meth:`generate`: tokens sampled before
        the pause keep the old label, those after it get the new one. Asleep, the update is
        held (copied) and applied at the wake."""
        weights = list(weights)
        if self._shapes is not None:  # vLLM loads tensor by tensor: refuse before the first
            check_fit(weights, self._shapes)
        with self._update_lock:  # the sender is made once, under it
            stage = self._weight_sender().stage_device  # host memory, or the GPU for ipc
            tensors = [(name, t.detach().to(stage).contiguous()) for name, t in weights]
            if self._sleep.in_server:
                self._held.hold(tensors, version)
                return
            self._request("POST", "/pause?mode=keep")
            try:
                self._apply(tensors, version)
            finally:
                self._request("POST", "/resume")
        logger.debug("server %s at version %d (%d tensors)", self.url, version, len(tensors))

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """start → broadcast → finish(version) → reset prefix cache, with generation paused
        (or the server asleep, its weights awake); under the update lock."""
        sender = self._weight_sender()
        if not sender.joined:  # the first update, or the first after a failed one
            sender.join(lambda info: self._request(
                "POST", "/init_weight_transfer_engine", {"init_info": info}))
        self._request("POST", "/start_weight_update")
        sender.send(tensors, lambda info: self._request(
            "POST", "/update_weights", {"update_info": info}),
            lambda: self._request("POST", "/finish_weight_update",
                                  {"weight_version": str(version)}))
        self._request("POST", "/reset_prefix_cache?reset_running_requests=true")
        self._version = version

    def _weight_sender(self) -> WeightSender:
        """The server's :class:`~rollouters.engines.vllm_sender.WeightSender`, made at the
        first update (it imports vLLM: only a worker that sends needs it)."""
        if self._sender is None:
            from rollouters.engines.vllm_gloo import BACKEND
            from rollouters.engines.vllm_sender import make_sender

            self._sender = make_sender(self._weight_backend or BACKEND, self._host, 1,
                                       self.timeout_s)
        return self._sender

    # --- sleep and wake (launcher.colocate) ------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleep.asleep

    def sleep(self) -> None:
        """Let this engine's generate calls in flight finish (new ones wait), then
        ``POST /sleep?level=1&mode=wait``: the server pauses its scheduler and frees the
        device memory, weights to host (:mod:`vllm_sleep`)."""
        self._sleep.sleep(lambda: self._request("POST", f"/sleep?level={SLEEP_LEVEL}&mode=wait"))

    def wake_up(self) -> None:
        """``/wake_up?tags=weights``, the update held while asleep, ``/wake_up?tags=kv_cache``
        (the server resumes its scheduler: :func:`~rollouters.engines.vllm_sleep.wake_in_order`);
        then the waiting generate calls go on."""
        self._sleep.wake(self._wake_tags, lambda: self._held.apply_with(self._apply))

    def _wake_tags(self, tags: list[str]) -> None:
        self._request("POST", "/wake_up?" + "&".join(f"tags={tag}" for tag in tags))

    def memory(self) -> dict[str, int]:
        """What the server holds, by :func:`~rollouters.engines.vllm_sleep.memory_report`:
        the sizes its worker reports (our extension's ``asyncrl_memory``, over the dev route
        ``/collective_rpc``, asked once)."""
        if self._sizes is None:
            self._sizes = self._rpc("asyncrl_memory")
        return memory_report(self._sizes, self._sleep.in_server, self._sleep_frees,
                             self._held.nbytes)

    def weight(self, name: str) -> torch.Tensor:
        """A parameter as the server's model holds it (tests: did an update land?)."""
        return torch.tensor(self._rpc("asyncrl_weight", name))

    def _rpc(self, method: str, *args: str) -> Any:
        """Our worker extension's ``method`` on the server's (first) worker."""
        reply = self._request("POST", "/collective_rpc", {"method": method, "args": list(args)})
        return reply["results"][0]

    # --- HTTP ------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return request_json(method, self.url, path, body, self.timeout_s, ServerError,
                            ServerError, "rollout.request_timeout_s")

    def close(self) -> None:
        """Forget the transfer group; stop the server if this worker launched it."""
        if self._sender is not None:
            self._sender.drop()
        self._sender = None
        if self._server is not None:
            self._server.stop()

