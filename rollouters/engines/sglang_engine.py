"""SGLang as a rollout engine: an HTTP client (:class:`SglangEngine`) and a weight-sync adapter
(:class:`SglangWeightPeer`) that lets the SGLang server join our learner broadcast as a peer.

Request and response shapes follow SGLang 0.5.x, ``python/sglang/srt/managers/io_struct.py``
(``GenerateReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``PauseGenerationReqInput``,
``UpdateWeightVersionReqInput``, ``UpdateWeightsFromTensorReqInput``,
``Begin/EndWeightUpdateReqInput``) served by ``srt/entrypoints/http_server.py``, last checked
against the 0.5.23 release (2026-10-30): its weight-update sessions, its refusal to flush the
cache while requests run, its alignment rule for flattened buckets and its per-token
``weight_versions`` are followed here. SGLang does not install on our CPU machines: tests use a
schema-checking fixture, and a real server where one exists. Over ``gloo`` and ``nccl``
weights never pass through this process: SGLang receives them itself from the learner's
broadcast (see :class:`SglangWeightPeer` for what that asks of the learner side). Over
``ipc`` this process lands them on the GPU it shares with the server and hands the server
CUDA IPC handles (``/update_weights_from_tensor``); that path builds SGLang's request as its
``io_struct`` defines it but has not met a real SGLang server.

In the colocated mode (``launcher.colocate``) the engine sleeps with SGLang's memory saver
(the server runs with ``--enable-memory-saver``): ``/release_memory_occupation`` of the
weights and the KV cache, and on waking ``/resume_memory_occupation`` of the weights, the
update that came while asleep, then of the KV cache: vLLM's order, and the same code
(:mod:`vllm_sleep`). The server receives the weights itself, so an update that comes while
asleep cannot be held here: it is deferred (:class:`~rollouters.engines.vllm_sleep.DeferredUpdate`),
its receiver waiting until the wake runs it. Tested against the schema-checking fixture only.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from asyncrl.weights.fit import check_fit
from asyncrl.weights.plan import BucketPlan, parse_dtype
from asyncrl.weights.receiver import WeightReceiver, agreed_transport
from asyncrl.weights.slices import Seat
from asyncrl.weights.transport import transport_kind
from buffers.protocol import ControlPlane
from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.http import http_status, request_json
from rollouters.engines.managed_server import ManagedServer, free_port
from rollouters.engines.vllm_sleep import DeferredUpdate, SleepCycle

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
FLATTENED = "flattened_bucket"  # SGLang's load_format for one uint8 broadcast per bucket
REQUEST_TIMEOUT_KEY = "rollout.request_timeout_s"  # sets timeout_s and generate_timeout_s
UPDATE_TIMEOUT_KEY = "weights.timeout_s"  # sets update_timeout_s (twice it: see make_engine)
MEMORY_TAGS = ["weights", "kv_cache"]  # what a sleep releases (SGLang's GPU memory types)
MEMORY_SAVER_FLAG = "--enable-memory-saver"  # a launched server that will sleep needs it


class SglangError(RuntimeError):
    """The server answered with an error (HTTP status >= 400, or ``success: false``)."""


class SglangTimeout(SglangError, TimeoutError):
    """The server did not answer within the call's timeout (or could not be reached)."""


def server_args(model_dir: str | Path, host: str, port: int, dtype: str, seed: int) -> list[str]:
    """The ``sglang.launch_server`` flags our engine needs: token ids in and out
    (``--skip-tokenizer-init``), one tensor-parallel rank (the weight group gives each server
    one rank, see :class:`SglangWeightPeer`)."""
    return ["--model-path", str(model_dir), "--host", host, "--port", str(port),
            "--skip-tokenizer-init", "--dtype", dtype, "--random-seed", str(seed),
            "--tp-size", "1"]


class SglangServer(ManagedServer):
    """An SGLang server this rollout worker launched and owns (``rollout.engine = "sglang"``
    without ``rollout.url``): ``python -m <module> <server_args> <extra>``, ready once
    ``GET /health`` answers (:class:`~rollouters.engines.managed_server.ManagedServer` starts,
    waits and stops it). It stays in the worker's process group, so whoever kills the
    worker's group (``asyncrl up``, a test) kills the server too; :meth:`stop` ends it with
    SIGTERM (SGLang's launcher then ends its scheduler and detokenizer processes)."""

    def __init__(self, module: str, model_dir: str | Path, dtype: str, seed: int,
                 extra: list[str], log_path: Path, start_timeout_s: float = 600.0,
                 host: str = "127.0.0.1") -> None:
        port = free_port(host)
        super().__init__(f"SGLang server ({module})",
                         [sys.executable, "-m", module,
                          *server_args(model_dir, host, port, dtype, seed), *extra],
                         f"http://{host}:{port}", log_path)
        self.wait_ready(start_timeout_s, "rollout.sglang.server_start_timeout_s", SglangError,
                        SglangTimeout)


class SglangEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over an SGLang server at ``url``.

    Every call has a timeout: ``timeout_s`` for control calls, ``generate_timeout_s`` for
    ``/generate`` (long sequences take a while), ``update_timeout_s`` for weight calls (they
    block for as long as the learner takes to broadcast). The policy version is tracked here
    and mirrored to the server as its ``weight_version`` string. ``shapes``: the model's
    tensor shapes (:func:`asyncrl.models.model_shapes`), which every update's manifest is
    checked against before the server joins its group (:mod:`asyncrl.weights.fit`); None:
    the server's own refusal, which may leave the update partial.

    ``pause_mode``: how generation pauses for an update. ``retract`` (default) moves the
    running requests back to SGLang's queue, so the update can flush the prefix cache the
    old weights filled, and the requests go on after it, their KV cache recomputed with the
    new weights. ``in_place`` keeps their KV cache and skips the flush (SGLang refuses one
    while requests run), so prompts cached before the update are reused after it.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, generate_timeout_s: float = 600.0,
                 update_timeout_s: float = 600.0, pause_mode: PauseMode = "retract",
                 version: int = 0, server: SglangServer | None = None,
                 eos_ids: tuple[int, ...] = (),
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.url = url.rstrip("/")
        self.shapes = shapes
        # Sent as stop_token_ids on every request: SGLang would otherwise stop only at the EOS
        # its own files name, and a tokenizer's EOS that generation_config leaves out
        # (<|im_end|> vs <|endoftext|>) would run the row to max_new_tokens.
        self.eos_ids = tuple(eos_ids)
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.update_timeout_s = update_timeout_s
        self.pause_mode = pause_mode
        # SGLang flushes its prefix cache with an update only when no request is running:
        # paused in place, requests stay running and the flush would fail the update.
        self.flushes = pause_mode != "in_place"
        self._sessions: bool | None = None  # does the server have weight-update sessions?
        self._version = version
        self._lock = threading.Lock()  # guards _version (generate threads vs the peer's)
        self._server = server  # launched by us: stopped by close()
        self._sleep_lock = threading.Lock()  # one update, sleep or wake at a time
        self._sleep = SleepCycle(self._sleep_lock)  # the gate generate calls pass
        self._deferred = DeferredUpdate()  # an update that came while asleep, for the wake

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    # --- HTTP ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], timeout_s: float,
              timeout_key: str = REQUEST_TIMEOUT_KEY) -> Any:
        """POST JSON, return the decoded answer; raise :class:`SglangError` on an HTTP error
        or ``success: false``, :class:`SglangTimeout` when no answer comes in time (a frozen
        server: the message names ``timeout_key``)."""
        answer = request_json("POST", self.url, path, body, timeout_s, SglangError,
                              SglangTimeout, timeout_key)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SglangError(f"{path}: {answer.get('message', 'failed')}")
        return {} if answer is None else answer

    # --- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False) -> list[list[Completion]]:
        """``n`` completions per prompt: one batched ``/generate``, each prompt repeated ``n``
        times (batch order is kept; ``sampling_params.n``'s expansion order is not relied on).

        Per-token versions: SGLang (0.5.23) says which weight version decoded which output
        tokens (``meta_info.weight_versions``, spans of the version strings our updates set),
        and each token takes its span's version (:func:`token_versions`). Where it does not
        (an older SGLang, or tokens of its initial weights, labelled ``default``), a token
        takes the OLDER of the versions in effect at submission and at completion (versions
        only grow: that is the one at submission). If no update happened meanwhile both are
        equal and the label is exact. If one did, the label understates freshness: the
        staleness filter may then drop a sample it could have kept, but never keeps one
        staler than allowed, and the behaviour logprobs are SGLang's own, so the importance
        ratios stay right either way."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy)
        rows = [list(p) for p in prompts for _ in range(n)]
        sampling: dict[str, Any] = {"temperature": 0.0 if greedy else temperature,
                                    "max_new_tokens": max_new_tokens}
        if self.eos_ids:
            sampling["stop_token_ids"] = list(self.eos_ids)
        body = {"input_ids": rows, "return_logprob": True, "sampling_params": sampling}
        with self._sleep.gate.call():  # asleep: waits for the wake
            started = self.version
            answer = self._post("/generate", body, self.generate_timeout_s)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(rows):
            raise SglangError(f"/generate: {len(items)} outputs for {len(rows)} inputs")
        now = self.version
        completions = [parse_completion(item, min(started, now), now) for item in items]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    # --- weights ---------------------------------------------------------------------------

    def pause(self) -> None:
        self._post("/pause_generation", {"mode": self.pause_mode}, self.timeout_s)

    @contextmanager
    def weight_session(self) -> Iterator[None]:
        """SGLang loads weights only inside a session (``/begin_weight_update`` ...
        ``/end_weight_update``, which finalises them); a server without these routes (404:
        SGLang before them) loads without one, and is not asked again. A session left open
        (its worker died mid-update) is closed first. The session is closed even when the
        update fails, so that the next one can open."""
        opened = self._begin_session()
        try:
            yield
        except BaseException:
            if opened:
                try:
                    self._end_session()
                except SglangError as exc:   # the update's own error is the one to raise
                    logger.warning("SGLang %s: could not close the weight-update session "
                                   "after a failed update: %s", self.url, exc)
            raise
        if opened:
            self._end_session()

    def _begin_session(self) -> bool:
        if self._sessions is False:
            return False
        try:
            self._post("/begin_weight_update", {}, self.update_timeout_s, UPDATE_TIMEOUT_KEY)
        except SglangError as exc:
            if http_status(exc) == 404:
                logger.info("SGLang %s has no weight-update sessions (an older SGLang): "
                            "updates load without them", self.url)
                self._sessions = False
                return False
            if "already open" not in str(exc):
                raise
            logger.warning("SGLang %s: a weight-update session was left open (a worker that "
                           "died mid-update?); closing it", self.url)
            self._end_session()
            self._post("/begin_weight_update", {}, self.update_timeout_s, UPDATE_TIMEOUT_KEY)
        self._sessions = True
        return True

    def _end_session(self) -> None:
        self._post("/end_weight_update", {}, self.update_timeout_s, UPDATE_TIMEOUT_KEY)

    def resume(self) -> None:
        self._post("/continue_generation", {}, self.timeout_s)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Pause around a weight update; resume even if the update fails, so a failed
        update costs one version, not a stuck engine."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int, group_name: str,
                                  backend: str) -> None:
        """Make the server join a broadcast group; returns once it has (the learner's side
        must be joining concurrently)."""
        self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, self.update_timeout_s, UPDATE_TIMEOUT_KEY)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Make the server forget a group it joined (it refuses to join a second group of
        the same name, and each group holds connections)."""
        self._post("/destroy_weights_update_group", {"group_name": group_name}, self.timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        flush_cache: bool, weight_version: str | None = None,
                                        load_format: str | None = None) -> None:
        """Receive one broadcast (a flattened bucket) or one per tensor; returns when done."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes,
                                "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        self._post("/update_weights_from_distributed", body, self.update_timeout_s,
                   UPDATE_TIMEOUT_KEY)

    def update_weights_from_tensor(self, serialized: list[str], flush_cache: bool,
                                   weight_version: str | None = None) -> None:
        """Load named tensors the server maps from this process's GPU memory (CUDA IPC),
        one serialized list per tensor-parallel rank; returns once loaded."""
        body: dict[str, Any] = {"serialized_named_tensors": serialized, "load_format": None,
                                "flush_cache": flush_cache, "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        self._post("/update_weights_from_tensor", body, self.update_timeout_s,
                   UPDATE_TIMEOUT_KEY)

    def update_weight_version(self, version: int) -> None:
        """Set the server's label without aborting anything (we pause ourselves)."""
        self._post("/update_weight_version",
                   {"new_version": str(version), "abort_all_requests": False}, self.timeout_s)

    def set_version(self, version: int) -> None:
        """Record that the server now holds ``version``."""
        with self._lock:
            self._version = version

    def update(self, send: Callable[[], None]) -> None:
        """Run a weight update, ``send`` (the requests that make the server take it), in a
        weight-update session (:meth:`weight_session`): awake, with generation paused around
        it; asleep, at the wake, between the resume of the
        weights and of the KV cache, while this call waits (up to ``update_timeout_s``:
        then :class:`SglangTimeout`, and the update is withdrawn)."""
        def in_session() -> None:
            with self.weight_session():
                send()

        with self._sleep_lock:
            if not self._sleep.in_server:
                with self.paused():
                    in_session()
                return
            waiting = self._deferred.defer(in_session)  # under the lock: before any wake
        if not self._deferred.wait(waiting, self.update_timeout_s):
            raise SglangTimeout(f"SGLang {self.url}: asleep for {self.update_timeout_s:.0f}s "
                                f"with an update waiting for the wake ({UPDATE_TIMEOUT_KEY})")

    # --- sleep and wake (launcher.colocate) ------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleep.asleep

    def sleep(self) -> None:
        """Let this engine's generate calls in flight finish (new ones wait; SGLang releases
        only an idle server's memory), then release the weights and the KV cache."""
        self._sleep.sleep(lambda: self._post("/release_memory_occupation",
                                             {"tags": MEMORY_TAGS}, self.update_timeout_s,
                                             UPDATE_TIMEOUT_KEY))

    def wake_up(self) -> None:
        """Resume the weights, run the deferred update (if one came), resume the KV cache
        (:func:`~rollouters.engines.vllm_sleep.wake_in_order`); then the waiting generate
        calls go on."""
        self._sleep.wake(lambda tags: self._post("/resume_memory_occupation", {"tags": tags},
                                                 self.update_timeout_s, UPDATE_TIMEOUT_KEY),
                         self._deferred.run)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Not supported: SGLang loads weights from its own process group (see
        :class:`SglangWeightPeer`); shipping tensors through this process would copy every
        byte twice and need ``update_weights_from_tensor``'s same-host serialisation."""
        raise NotImplementedError("SglangEngine receives weights through SglangWeightPeer")

    def weight_receiver(self, control: ControlPlane, member: str) -> SglangWeightPeer:
        """This engine's side of the weight sync: the server receives the broadcast itself,
        this process only follows the announcements and asks it (:class:`SglangWeightPeer`)."""
        return SglangWeightPeer(control, member, self)

    def close(self) -> None:
        """Stop the server if we launched it (an attached one keeps running: it is not ours);
        every HTTP call opens and closes its own connection."""
        if self._server is not None:
            self._server.stop()


def token_versions(meta: dict[str, Any], count: int, version: int, newest: int) -> list[int]:
    """The policy version of each of ``count`` output tokens: from SGLang's
    ``meta_info.weight_versions`` (``[{"version", "start", "end"}]``, output-token indices,
    end exclusive) where a span names one of our versions (no newer than ``newest``, the
    engine's own at completion), else ``version`` (a server without spans, its initial
    weights' ``default``, a token no span covers)."""
    versions = [version] * count
    for span in meta.get("weight_versions") or ():
        label = str(span.get("version", ""))
        if label.isdigit():
            start, end = max(int(span.get("start", 0)), 0), min(int(span.get("end", 0)), count)
            versions[start:end] = [min(int(label), newest)] * max(end - start, 0)
    return versions


def parse_completion(item: dict[str, Any], version: int, newest: int | None = None
                     ) -> Completion:
    """One ``/generate`` output. ``meta_info.output_token_logprobs`` is a list of
    ``[logprob, token_id, text]`` (text is null unless ``return_text_in_logprobs``): see
    ``TokenizerManager.detokenize_logprob_tokens`` in SGLang's
    ``srt/managers/tokenizer_manager.py``. The logprobs are after temperature unless the
    server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (do not set it for RL).
    ``finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``. Token versions:
    :func:`token_versions` (``newest`` defaults to ``version``)."""
    meta = item["meta_info"]
    triples = meta["output_token_logprobs"]
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    if "output_ids" in item and list(item["output_ids"]) != tokens:
        raise SglangError("output_ids and output_token_logprobs disagree")
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    if reason == "abort":
        raise SglangError(f"request aborted: {meta.get('finish_reason')}")
    versions = token_versions(meta, len(tokens), version,
                              version if newest is None else newest)
    return Completion(tokens=tokens, logprobs=logprobs, versions=versions,
                      finish_reason="stop" if reason == "stop" else "length")


class SglangWeightPeer(WeightReceiver):
    """The rollout side of the weight sync for an SGLang engine: follows the announcements of
    :class:`asyncrl.weights.broadcaster.WeightBroadcaster` exactly like :class:`WeightReceiver`
    (same join → go handshake, same acks, same eviction), but the group member is the SGLang
    server, not this process. On a new epoch it asks the server to join the group
    (``/init_weights_update_group`` with the announcement's ``group`` name, our rank as
    ``rank_offset`` and the backend); on each update it pauses generation, asks for one
    ``/update_weights_from_distributed`` per bucket with that bucket's names/dtypes/shapes and
    ``load_format = "flattened_bucket"`` (SGLang then receives the bucket as ONE flat
    ``uint8`` broadcast, the same collective our broadcaster sends), resumes, and acks. When
    it leaves a group it asks the server to ``/destroy_weights_update_group`` it.

    What this asks of the learner side (done there):

    * its side of the group uses the store layout of SGLang's ``init_custom_process_group``
      (rendezvous at ``master_address:master_port``, which is our store; keys under
      ``PrefixStore(group_name)`` then torch's ``f"{group_name}/"`` and ``"cpu/"`` prefixes):
      :meth:`asyncrl.weights.group.GroupTransport.connect` builds exactly that chain;
    * buckets are packed without padding (``align = 1``,
      :func:`asyncrl.weights.broadcaster.broadcast_align`), because SGLang's
      ``FlattenedTensorBucket`` concatenates the tensors' bytes back to back;
      :func:`sglang_requests` refuses a padded plan rather than let the collective fail;
    * one rank per server: SGLang joins as ``rank_offset + tp_rank``, and the announcement
      gives every member one rank, so servers must run with ``tp_size = 1`` (data-parallel
      fleets are fine: one worker and one server each);
    * NCCL on GPU: SGLang receives into CUDA memory, so a gloo group works only if its
      build supports CUDA tensors; ``backend = "nccl"`` is the intended setting there.
    """

    def __init__(self, control: ControlPlane, member: str, engine: SglangEngine,
                 host: str = "127.0.0.1", poll_s: float = 0.25) -> None:
        super().__init__(control, member, self._applied, host, poll_s)
        self.engine = engine
        self.pause_s: list[float] = []  # per update: pause → resume, for metrics and benches
        self._version_in_flight = -1
        self._group_name: str | None = None  # the server's current group
        self._by_tensor = False  # this epoch's transport hands tensors over (ipc)

    def _serve(self, ann: dict[str, Any]) -> None:
        """As :class:`WeightReceiver`, after checking the update's manifest against the
        model's shapes: the server loads bucket by bucket, so a refusal of its own could leave
        the update partial; refused here, the server never joins the group."""
        self._version_in_flight = int(ann.get("version", -1))  # read by _receive below
        if self.engine.shapes is not None and self.member in ann.get("members", []):
            check_fit([(spec["name"], spec["shape"]) for spec in ann["manifest"]],
                      self.engine.shapes)
        super()._serve(ann)

    def _applied(self, named: dict[str, torch.Tensor], version: int) -> None:
        self.engine.set_version(version)

    def _join(self, ann: dict[str, Any], place: Seat) -> bool:
        """The same handshake as :class:`WeightReceiver`, then the server joins the group of
        its slice (with one learner rank sending: the epoch's group)."""
        decision = self._handshake(ann)
        if decision is None:
            return False
        backend = transport_kind(agreed_transport(ann, decision, place.slice)).torch_backend
        self._by_tensor = backend is None
        if self._by_tensor:  # ipc: this process receives, the server maps our buffers
            self._connect(ann, decision, place)
            return True
        store, epoch = ann["store"], int(ann["epoch"])
        host, port = store.rsplit(":", 1)
        self._group_name = place.group
        self.engine.init_weights_update_group(host, int(port), place.rank, place.world,
                                              place.group, backend)
        self._group_id = (store, epoch)
        logger.info("weights: SGLang %s joined %s as rank %d/%d over %s", self.member,
                    place.group, place.rank, place.world, backend)
        return True

    def _receive(self, plan: BucketPlan) -> dict[str, torch.Tensor]:
        """Pause, one request per bucket (the server receives it), resume; no tensors here.
        Over ipc: every bucket lands in this process's pool first, then the paused server
        loads them bucket by bucket from handles to that pool. With the engine asleep the
        requests wait for its wake (:meth:`SglangEngine.update`; ``pause_s`` then counts the
        wait too)."""
        version = self._version_in_flight
        if self._by_tensor:
            named = super()._receive(plan)
            handles = tensor_requests(plan, named, version, flush=self.engine.flushes)

            def load() -> None:
                for request in handles:
                    self.engine.update_weights_from_tensor(**request)
                self.engine.set_version(version)

            started = time.monotonic()
            self.engine.update(load)  # asleep: waits for the wake (the pool stays ours)
            self.pause_s.append(time.monotonic() - started)
            return {}
        assert self._group_name is not None
        requests, group = sglang_requests(plan), self._group_name

        def send() -> None:
            for index, request in enumerate(requests):
                last = index == len(requests) - 1
                self.engine.update_weights_from_distributed(
                    **request, group_name=group, flush_cache=last and self.engine.flushes,
                    weight_version=str(version) if last else None, load_format=FLATTENED)
            self.engine.set_version(version)  # before generation goes on (or the wake ends)

        started = time.monotonic()
        self.engine.update(send)  # asleep: waits for the wake, which runs it
        self.pause_s.append(time.monotonic() - started)
        return {}

    def _leave(self) -> None:
        """Our side as :class:`WeightReceiver`, then the server's: it keeps every group it
        joined by name until told to destroy it. Best effort: a dead learner or a server
        that never joined must not stop the next epoch."""
        super()._leave()
        name, self._group_name = self._group_name, None
        if name is not None:
            try:
                self.engine.destroy_weights_update_group(name)
            except SglangError as exc:
                logger.warning("weights: SGLang %s could not drop %s: %s", self.member, name,
                               exc)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)``: torch's
    multiprocessing pickler (CUDA tensors become IPC handles) in base64. Only CUDA tensors
    can reach another process this way over HTTP (CPU ones travel as file descriptors)."""
    import base64
    import io

    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions it uses

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def tensor_requests(plan: BucketPlan, named: dict[str, torch.Tensor], version: int,
                    tp_size: int = 1, flush: bool = True) -> list[dict[str, Any]]:
    """The ``/update_weights_from_tensor`` arguments of one update, one per bucket: that
    bucket's named tensors (``load_format`` None: a list of ``(name, tensor)``), the same
    for every tensor-parallel rank; the last sets the version, and flushes the cache if
    ``flush`` (:attr:`SglangEngine.flushes`)."""
    out = []
    count = len(plan.bucket_nbytes)
    for index in range(count):
        last = index == count - 1
        payload = serialize_named_tensors([(s.name, named[s.name]) for s in plan.in_bucket(index)])
        out.append({"serialized": [payload] * tp_size, "flush_cache": last and flush,
                    "weight_version": str(version) if last else None})
    return out


def sglang_requests(plan: BucketPlan) -> list[dict[str, list[Any]]]:
    """``{names, dtypes, shapes}`` per bucket, for ``load_format = "flattened_bucket"``.

    Raises ``ValueError`` when a bucket has padding (SGLang would expect fewer bytes than the
    learner sends, and the collective would fail): the learner must plan with ``ALIGN = 1``
    for SGLang peers; and when a tensor starts misaligned for its dtype, which SGLang refuses
    before it receives, leaving the learner's broadcast to time out
    (:func:`~asyncrl.weights.plan.plan_buckets` never plans one)."""
    out = []
    for index, nbytes in enumerate(plan.bucket_nbytes):
        specs = plan.in_bucket(index)
        offset = 0
        for spec in specs:
            if spec.offset != offset:
                raise ValueError(f"bucket {index}: {spec.name} at byte {spec.offset}, SGLang "
                                 f"expects {offset}: plan SGLang peers without alignment")
            if offset % parse_dtype(spec.dtype).itemsize:
                raise ValueError(f"bucket {index}: {spec.name} ({spec.dtype}) at byte "
                                 f"{offset}, misaligned for its dtype: SGLang refuses it")
            offset += spec.nbytes
        if offset != nbytes:
            raise ValueError(f"bucket {index}: {nbytes} bytes, tensors hold {offset}")
        out.append({"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                    "shapes": [list(s.shape) for s in specs]})
    return out
