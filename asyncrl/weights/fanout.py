"""Fan-out from every learner rank: each of ``M`` learner ranks serves a slice of the engines.

At scale the sync time is the fan-out, not the gather: a broadcast from one rank moves the
whole model once per engine through that rank's links. Every learner rank gathers each
bucket anyway, so each can be the root of a group over its own slice of the engines, and the
sending bandwidth grows with ``M``. This is a change of plan, not of format: the announcement
gains ``"senders": M``, and the rest (manifest, buckets, epochs, the join → go handshake,
acks, eviction, timeouts) is what :mod:`asyncrl.weights.broadcaster` documents.

- :func:`~asyncrl.weights.slices.slices`: engine ``i`` of the sorted members is served by
  learner rank ``i % M``, so the slices differ by one engine at most and every party
  computes them alike.
- :func:`~asyncrl.weights.slices.seat`: where one engine sits: the group of its slice
  (``<group>-s<k>``; with one sender the epoch's group name itself, so an SGLang server
  meets exactly the group it met before), its rank in it and the group's size.
- :class:`SliceSender`: learner rank ``k >= 1``'s end. It follows the announcements like a
  receiver (it is one, in reverse), joins the handshake as ``learner-sender-<k>`` (rank 0
  waits for its join as for an engine's; a sender that does not join fails the attempt, it
  is not evicted: learner ranks live and die together), and broadcasts the buckets of the
  version it was offered (:meth:`SliceSender.offer`) as rank 0 of its slice's group. The
  engines ack to rank 0 as always: rank 0 alone decides that a version is delivered.

Each group's transport is chosen per slice (``weights.transport = "auto"``): a learner rank
that shares its GPU with its engines uses ``ipc``, another ``nccl``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.control_plane import ControlPlane
from asyncrl.weights.plan import BucketBuffers, BucketPlan, new_staging, stage, staging_fits
from asyncrl.weights.receiver import WATCH_S, Superseded, WeightReceiver, agreed_transport
from asyncrl.weights.rendezvous import ANNOUNCE_KEY, dial_store
from asyncrl.weights.slices import sender_name, slice_group, slices
from asyncrl.weights.transport import Pending, make_transport

logger = logging.getLogger(__name__)

class SliceSender(WeightReceiver):
    """Learner rank ``rank`` (>= 1): sends each announced version to its slice of engines.

    ``control`` is a client of its own (only this thread uses it). :meth:`offer` hands it
    the state of a version (the same names, shapes and dtypes as rank 0's, on ``device``);
    the state must stay unchanged until the version is sent or a newer one is offered. A
    version announced but not offered within ``timeout_s`` is skipped (its engines then do
    not ack, and rank 0 evicts them as for any lost bucket). :attr:`sent_bytes` and
    :attr:`sent_engines` count what this rank delivered (bytes x engines), for metrics.
    """

    def __init__(self, control: ControlPlane, rank: int, host: str = "127.0.0.1",
                 poll_s: float = 0.25, device: torch.device | None = None) -> None:
        super().__init__(control, sender_name(rank), lambda named, version: None, host,
                         poll_s, device=device)
        self.rank = rank
        self._offer_cv = threading.Condition()
        self._offered: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._staging: BucketBuffers | None = None
        self.sent_bytes = 0
        self.sent_engines = 0
        self.sent_versions: list[int] = []

    def offer(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """The weights of ``version`` (kept by reference: leave them unchanged)."""
        with self._offer_cv:
            self._offered = (version, state)
            self._offer_cv.notify_all()

    def _serve(self, ann: dict[str, Any]) -> None:
        name = self.member
        senders = int(ann.get("senders", 1))
        part = slices(ann.get("members", []), senders)[self.rank] if self.rank < senders else []
        if not part:
            self._leave()  # closed, or nothing for this rank to serve
            return
        group_id = (ann["store"], int(ann["epoch"]))
        if self._group_id != group_id:
            self._leave()
            if not self._open(ann, senders, len(part) + 1):
                return
        version = int(ann["version"])
        state = self._state_of(version, float(ann["timeout_s"]))
        if state is None:
            logger.warning("weights: %s was not offered version %d in time", name, version)
            return
        plan = BucketPlan.from_json(ann["manifest"], ann["buckets"])
        self._send(plan, state)
        self.sent_bytes += plan.total_bytes * len(part)
        self.sent_engines += len(part)
        self.sent_versions.append(version)

    def _open(self, ann: dict[str, Any], senders: int, world: int) -> bool:
        """The handshake under this rank's name, then rank 0 of this slice's group."""
        decision = self._handshake(ann)
        if decision is None:
            return False
        store, epoch, timeout_s = ann["store"], int(ann["epoch"]), float(ann["timeout_s"])
        self._store = dial_store(store, timeout_s)
        transport = make_transport(agreed_transport(ann, decision, self.rank), host=self._host,
                                   timeout_s=timeout_s, device=self.device,
                                   **ann.get("transport_opts", {}))
        transport.connect(self._store, slice_group(ann["group"], senders, self.rank), 0, world)
        self._transport, self._group_id = transport, (store, epoch)
        logger.info("weights: learner rank %d serves %d engines in epoch %d", self.rank,
                    world - 1, epoch)
        return True

    def _state_of(self, version: int, timeout_s: float) -> Mapping[str, torch.Tensor] | None:
        deadline = time.monotonic() + timeout_s
        with self._offer_cv:
            while self._offered is None or self._offered[0] < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return None
                self._offer_cv.wait(min(remaining, self._poll_s))
            offered_version, state = self._offered
        return state if offered_version == version else None

    def _send(self, plan: BucketPlan, state: Mapping[str, torch.Tensor]) -> None:
        """Every bucket, packing bucket i+1 while bucket i is on the wire (two staging
        slots, as rank 0 does); a newer announcement during a slow bucket ends the send."""
        transport = self._transport
        assert transport is not None
        device = transport.buffer_device()
        if not staging_fits(self._staging, plan, state, device):
            self._staging = None
            self._staging = new_staging(plan, state, device)
        pending: Pending | None = None
        try:
            for index in range(len(plan.bucket_nbytes)):
                work = transport.send(stage(plan, index, state, self._staging, device))
                if pending is not None:
                    self._watch(pending)
                pending = work
            if pending is not None:
                self._watch(pending)
        except BaseException:
            self._staging = None  # a bucket may still be read from it: never repack it
            raise

    def _watch(self, pending: Pending) -> None:
        while not pending.wait(WATCH_S):
            if self._control.get_key(ANNOUNCE_KEY, newer_than=self._seq) is not None:
                raise Superseded("a newer announcement came during the send")
