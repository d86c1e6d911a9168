"""SGLang as a rollout engine: an HTTP client (:class:`SglangEngine`) and a weight-sync adapter
(:class:`SglangWeightPeer`) that lets the SGLang server join our learner broadcast as a peer.

Request and response shapes follow SGLang 0.5.x, ``python/sglang/srt/managers/io_struct.py``
(``GenerateReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``PauseGenerationReqInput``,
``UpdateWeightVersionReqInput``) served by ``srt/entrypoints/http_server.py``. SGLang does
not install on our CPU machines: tests use a schema-checking fixture, and a real server where
one exists. Weights never pass through this process: SGLang receives them itself from the
learner's broadcast (see :class:`SglangWeightPeer` for what that asks of the learner side).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from buffers.protocol import ControlPlane
from learners.weights_plan import BucketPlan
from learners.weights_receiver import WeightReceiver
from rollouters.engines.base import Completion

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
FLATTENED = "flattened_bucket"  # SGLang's load_format for one uint8 broadcast per bucket


class SglangError(RuntimeError):
    """The server answered with an error (HTTP status >= 400, or ``success: false``)."""


class SglangTimeout(TimeoutError):
    """The server did not answer within the call's timeout (or could not be reached)."""


class SglangEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over an SGLang server at ``url``.

    Every call has a timeout: ``timeout_s`` for control calls, ``generate_timeout_s`` for
    ``/generate`` (long sequences take a while), ``update_timeout_s`` for weight calls (they
    block for as long as the learner takes to broadcast). The policy version is tracked here
    and mirrored to the server as its ``weight_version`` string.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, generate_timeout_s: float = 600.0,
                 update_timeout_s: float = 600.0, pause_mode: PauseMode = "in_place",
                 version: int = 0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.update_timeout_s = update_timeout_s
        self.pause_mode = pause_mode
        self._version = version
        self._lock = threading.Lock()  # guards _version (generate threads vs the peer's)

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    # --- HTTP ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """POST JSON, return the decoded answer; raise :class:`SglangError` on an HTTP error
        or ``success: false``, :class:`SglangTimeout` when no answer comes in time."""
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise SglangError(f"{path}: HTTP {exc.code}: {detail}") from exc
        except TimeoutError as exc:
            raise SglangTimeout(f"{path}: no answer within {timeout_s:.1f}s") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise SglangTimeout(f"{path}: no answer within {timeout_s:.1f}s") from exc
            raise SglangError(f"{path}: {self.url} unreachable: {exc.reason}") from exc
        answer = json.loads(raw) if raw.strip() else {}
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SglangError(f"{path}: {answer.get('message', 'failed')}")
        return answer

    # --- generation ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False) -> list[list[Completion]]:
        """``n`` completions per prompt: one batched ``/generate``, each prompt repeated ``n``
        times (batch order is kept; ``sampling_params.n``'s expansion order is not relied on).

        Per-token versions: SGLang does not say which tokens were decoded before and which
        after a weight update, so every token is labelled with the OLDER of the versions in
        effect at submission and at completion (versions only grow: that is the one at
        submission). If no update happened meanwhile both are equal and the label is exact.
        If one did, the label understates freshness: the staleness filter may then drop a
        sample it could have kept, but never keeps one staler than allowed, and the behaviour
        logprobs are SGLang's own, so the importance ratios stay right either way."""
        if not prompts or n < 1 or max_new_tokens < 1 or any(not p for p in prompts):
            raise ValueError("need non-empty prompts, n >= 1 and max_new_tokens >= 1")
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        rows = [list(p) for p in prompts for _ in range(n)]
        body = {"input_ids": rows, "return_logprob": True,
                "sampling_params": {"temperature": 0.0 if greedy else temperature,
                                    "max_new_tokens": max_new_tokens}}
        started = self.version
        answer = self._post("/generate", body, self.generate_timeout_s)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(rows):
            raise SglangError(f"/generate: {len(items)} outputs for {len(rows)} inputs")
        version = min(started, self.version)
        completions = [parse_completion(item, version) for item in items]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    # --- weights ---------------------------------------------------------------------------

    def pause(self) -> None:
        self._post("/pause_generation", {"mode": self.pause_mode}, self.timeout_s)

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
            "backend": backend}, self.update_timeout_s)

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
        self._post("/update_weights_from_distributed", body, self.update_timeout_s)

    def update_weight_version(self, version: int) -> None:
        """Set the server's label without aborting anything (we pause ourselves)."""
        self._post("/update_weight_version",
                   {"new_version": str(version), "abort_all_requests": False}, self.timeout_s)

    def set_version(self, version: int) -> None:
        """Record that the server now holds ``version``."""
        with self._lock:
            self._version = version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Not supported: SGLang loads weights from its own process group (see
        :class:`SglangWeightPeer`); shipping tensors through this process would copy every
        byte twice and need ``update_weights_from_tensor``'s same-host serialisation."""
        raise NotImplementedError("SglangEngine receives weights through SglangWeightPeer")

    def close(self) -> None:
        """Nothing to release: every HTTP call opens and closes its own connection."""


def parse_completion(item: dict[str, Any], version: int) -> Completion:
    """One ``/generate`` output. ``meta_info.output_token_logprobs`` is a list of
    ``[logprob, token_id, text]`` (text is null unless ``return_text_in_logprobs``): see
    ``TokenizerManager.detokenize_logprob_tokens`` in SGLang's
    ``srt/managers/tokenizer_manager.py``. The logprobs are after temperature unless the
    server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (do not set it for RL).
    ``finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``."""
    meta = item["meta_info"]
    triples = meta["output_token_logprobs"]
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    if "output_ids" in item and list(item["output_ids"]) != tokens:
        raise SglangError("output_ids and output_token_logprobs disagree")
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    if reason == "abort":
        raise SglangError(f"request aborted: {meta.get('finish_reason')}")
    return Completion(tokens=tokens, logprobs=logprobs, versions=[version] * len(tokens),
                      finish_reason="stop" if reason == "stop" else "length")


class SglangWeightPeer(WeightReceiver):
    """The rollout side of the weight sync for an SGLang engine: follows the announcements of
    :class:`learners.weights.WeightBroadcaster` exactly like :class:`WeightReceiver` (same
    join → go handshake, same acks, same eviction), but the group member is the SGLang
    server, not this process. On a new epoch it asks the server to join the group
    (``/init_weights_update_group`` with ``group_name = "epoch<N>"``); on each update it
    pauses generation, asks for one ``/update_weights_from_distributed`` per bucket with that
    bucket's names/dtypes/shapes and ``load_format = "flattened_bucket"`` (SGLang then
    receives the bucket as ONE flat ``uint8`` broadcast, the same collective our broadcaster
    sends), resumes, and acks.

    What the learner must do differently for SGLang peers (not done here):

    * create its side of the group the way SGLang's ``init_custom_process_group`` does:
      ``torch.distributed`` rendezvous at ``master_address:master_port`` (our store), keys
      under ``PrefixStore(f"{group_name}/")`` and the backend's own device prefix, i.e.
      through torch's ``_new_process_group_helper`` with the same ``group_name`` (and the
      same torch version on both sides), not a bare ``ProcessGroupGloo(PrefixStore(...))``;
      and ``world_size`` must count every tensor-parallel rank of the server;
    * pack buckets without padding: SGLang's ``FlattenedTensorBucket`` concatenates the
      tensors' bytes back to back, while our plan aligns offsets to 16 bytes. A plan with
      ``ALIGN = 1`` for SGLang peers (or any plan whose padding happens to be zero, which
      :func:`sglang_requests` checks) is byte-identical;
    * NCCL on GPU: SGLang receives into CUDA memory, so a gloo group works only if its
      build supports CUDA tensors; ``backend = "nccl"`` is the intended setting there.
    """

    def __init__(self, control: ControlPlane, member: str, engine: SglangEngine,
                 host: str = "127.0.0.1", poll_s: float = 0.25) -> None:
        super().__init__(control, member, self._applied, host, poll_s)
        self.engine = engine
        self.pause_s: list[float] = []  # per update: pause → resume, for metrics and benches
        self._version_in_flight = -1

    def _serve(self, ann: dict[str, Any]) -> None:
        self._version_in_flight = int(ann.get("version", -1))  # read by _receive below
        super()._serve(ann)

    def _applied(self, named: dict[str, torch.Tensor], version: int) -> None:
        self.engine.set_version(version)

    def _join(self, ann: dict[str, Any], rank: int, world: int) -> bool:
        """The same handshake as :class:`WeightReceiver`, then the server joins the group."""
        if not self._handshake(ann):
            return False
        store, epoch = ann["store"], int(ann["epoch"])
        host, port = store.rsplit(":", 1)
        self.engine.init_weights_update_group(host, int(port), rank, world, f"epoch{epoch}",
                                              ann.get("transport", "gloo"))
        self._group_id = (store, epoch)
        logger.info("weights: SGLang %s joined epoch %d as rank %d/%d", self.member, epoch,
                    rank, world)
        return True

    def _receive(self, plan: BucketPlan, transport: str) -> dict[str, torch.Tensor]:
        """Pause, one request per bucket (the server receives it), resume; no tensors here."""
        assert self._group_id is not None
        group_name = f"epoch{self._group_id[1]}"
        version = self._version_in_flight
        requests = sglang_requests(plan)
        started = time.monotonic()
        with self.engine.paused():
            for index, request in enumerate(requests):
                last = index == len(requests) - 1
                self.engine.update_weights_from_distributed(
                    **request, group_name=group_name, flush_cache=last,
                    weight_version=str(version) if last else None, load_format=FLATTENED)
        self.pause_s.append(time.monotonic() - started)
        return {}


def sglang_requests(plan: BucketPlan) -> list[dict[str, list[Any]]]:
    """``{names, dtypes, shapes}`` per bucket, for ``load_format = "flattened_bucket"``.

    Raises ``ValueError`` when a bucket has padding (SGLang would expect fewer bytes than the
    learner sends, and the collective would fail): the learner must plan with ``ALIGN = 1``
    for SGLang peers."""
    out = []
    for index, nbytes in enumerate(plan.bucket_nbytes):
        specs = plan.in_bucket(index)
        offset = 0
        for spec in specs:
            if spec.offset != offset:
                raise ValueError(f"bucket {index}: {spec.name} at byte {spec.offset}, SGLang "
                                 f"expects {offset}: plan SGLang peers without alignment")
            offset += spec.nbytes
        if offset != nbytes:
            raise ValueError(f"bucket {index}: {nbytes} bytes, tensors hold {offset}")
        out.append({"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                    "shapes": [list(s.shape) for s in specs]})
    return out
