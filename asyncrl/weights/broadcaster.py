"""Learner → engine weight sync: :class:`WeightBroadcaster` on learner rank 0.

One update, as seen on the control plane (``weights/announce``)::

    {"version": int, "epoch": int, "members": [member, ...],   # rank = index + 1
     "store": "host:port", "group": str, "transport": str, "transport_opts": {...},
     "senders": int, "timeout_s": float,
     "manifest": [{"name", "shape", "dtype", "bucket", "offset", "nbytes"}, ...],
     "buckets": [{"nbytes", "count"}, ...]}

Members are the alive ``rollout`` members of the control plane that have not said they
stopped, sorted. A *membership epoch* is one group over them (named ``group``, see
:func:`asyncrl.weights.rendezvous.group_name`), carried by the transport ``transport`` names
(:mod:`asyncrl.weights.transport`: ``gloo`` or ``nccl`` with SGLang's store layout so an
SGLang server can be a member, ``ipc`` on a shared GPU, or ``sim``; ``auto`` is decided per
epoch at the go, from the devices the joins report: ``weights/group`` then carries the
``transports``, one per slice), built with the announced ``transport_opts``; it is reused
while the members and the options stay the same. (With ``senders`` M > 1, learner rank k
serves the k-th slice of the members in a group of its own, :mod:`asyncrl.weights.fanout`;
rank 0 still announces, decides the go and collects the acks.) When the members or the
options change, the new epoch starts with a handshake on the control plane so that nobody
blocks on a dead peer: receivers write ``weights/join/<member>`` ``{"epoch", "store",
"device"}``, the broadcaster waits for all of them (up to ``timeout_s``, less if one is lost:
see below) and writes ``weights/group`` ``{"epoch", "store", "go", "transports"}``; only after
``go`` does anyone create the group. Then every bucket is broadcast from rank 0 and each
receiver acks with ``weights/ack/<member>`` ``{"version", "epoch", "store"}`` (epoch and store
make an ack from an earlier group, or an earlier learner, count for nothing).

Buckets are pipelined: bucket *i+1* is packed into one of two persistent staging buffers while
bucket *i* is on the wire (at most two in flight). The staging buffers live as long as the
plan (names, shapes, dtypes, bucket size) stays the same, because fresh ones page-fault on
every byte; a changed plan rebuilds them.

A member that does not join or ack in time is evicted (and the group dropped, so the next
attempt rebuilds it without that member); a failed collective drops the group and the next
attempt's handshake finds who is gone. Nobody waits for a member that is *lost*
(:mod:`asyncrl.weights.membership`): one that *departed*, that the control plane no longer
reports alive (silent past ``buffer.heartbeat_timeout_s``: a SIGKILLed engine, whose
supervisor may have restarted it under a new name already) or that said it stopped; or one
gone *silent*, listed alive but not heard from for half of ``weights.timeout_s`` (a
SIGSTOPped engine: alive, but it will neither join, ack nor take its part in a collective).
Every wait (joins, acks, and each bucket that takes long to go out) asks the control plane
who is lost once a second; a lost member is evicted at once, named with the reason in a
warning (``weights: evicted rollout-1-42: no heartbeat for 2.6 s during version 7
(frozen?)``), and the others get the version without it: those that acked it already count
as delivered, the rest get it in a new epoch at once. A frozen engine therefore costs the
others half of ``weights.timeout_s`` and one resend, not the group's timeout twice over;
a live engine that is only slow is still waited for up to ``timeout_s``. An evicted member
is left out until it heartbeats again after its eviction (a SIGCONTinued one rejoins at the
next update); :meth:`WeightBroadcaster.evictions` says who is out and why.

A group abandoned while a bucket is still in flight (a frozen peer holds it until the group's
timeout) is released by the transport without waiting for it, and its staging buffers are
dropped with it: a bucket still pending must not be repacked under its feet.
:class:`~asyncrl.weights.receiver.WeightReceiver` (the rollout side) lives in
:mod:`asyncrl.weights.receiver`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config.schema import WeightsConfig
from asyncrl.control_plane import ControlPlane
from asyncrl.engine_kinds import engine_kind
from asyncrl.weights.membership import Membership
from asyncrl.weights.plan import (
    ALIGN,
    BucketBuffers,
    BucketPlan,
    new_staging,
    plan_buckets,
    stage,
    staging_fits,
)
from asyncrl.weights.rendezvous import (
    ANNOUNCE_KEY,
    GROUP_KEY,
    ack_key,
    await_keys,
    group_name,
    join_key,
    serve_store,
)
from asyncrl.weights.slices import sender_name, slice_group, slices
from asyncrl.weights.transport import (
    Pending,
    WeightTransport,
    announced_opts,
    choose_transport,
    describe_device,
    make_transport,
    transport_kind,
)

__all__ = ["WeightBroadcaster", "broadcast_align", "engine_weights"]

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a lost peer: the 1st attempt fails, the 2nd finds who, the 3rd delivers
WATCH_S = 1.0  # a wait asks the control plane who is lost this often


@dataclass
class _Group:
    epoch: int
    members: tuple[str, ...]
    transport: WeightTransport


def engine_weights(cfg: WeightsConfig, engine: str) -> WeightsConfig:
    """``cfg`` as engines of kind ``engine`` (``rollout.engine``) need it: one whose server
    makes one blocking HTTP request per bucket while paused (SGLang) gets every tensor packed
    into buckets (``alone_mb = 0``): few large requests, not one per tensor
    (:attr:`~asyncrl.engine_kinds.EngineKind.packs_every_tensor`)."""
    packs_all = engine_kind(engine).packs_every_tensor
    return cfg.model_copy(update={"alone_mb": 0.0}) if packs_all else cfg


def broadcast_align(engine: str) -> int:
    """The bucket alignment the engines of kind ``engine`` (``rollout.engine``) can receive:
    SGLang's flattened buckets carry no padding, our receivers take any alignment
    (:attr:`~asyncrl.engine_kinds.EngineKind.bucket_align`)."""
    align = engine_kind(engine).bucket_align
    return ALIGN if align is None else align


class WeightBroadcaster:
    """Sends each new version to every rollout engine; never hangs on, or dies of, a lost one.

    ``control`` is used only from the thread that calls :meth:`sync` (clients are not
    thread-safe). The store server lives as long as this object; groups come and go with
    membership epochs. ``align`` is the plan's tensor alignment in a bucket: 1 for SGLang
    peers, whose ``flattened_bucket`` receive expects the tensors' bytes back to back (see
    :func:`rollouters.engines.sglang_engine.sglang_requests`); :func:`broadcast_align` picks it.
    ``device``: the learner's compute device, which ``weights.transport = "auto"`` compares
    with the engines' (the gathered state may sit in host memory: FSDP2 offloads it there);
    None: the device of the state each sync is given. ``senders``: learner ranks that send,
    each to its slice of the engines (:mod:`asyncrl.weights.fanout`).
    """

    def __init__(self, control: ControlPlane, cfg: WeightsConfig, host: str = "127.0.0.1",
                 align: int = ALIGN, sim_sync_s: float = 0.0, senders: int = 1,
                 device: torch.device | None = None):
        self._control = control
        self._senders = max(1, senders)  # learner ranks sending, each to its slice (fanout)
        self._sender_names = {sender_name(k) for k in range(1, self._senders)}
        self._cfg = cfg
        self._host = host
        self._align = align
        self._sim_sync_s = sim_sync_s  # transport "sim": seconds one whole update takes
        transport_kind(cfg.transport)  # raises for an unknown one
        self._learner_device = device
        self._device: torch.device | None = None  # the learner's, or its state's, per sync
        self.transport = ""  # the last epoch's, as the handshake decided it
        self._transport_opts: dict[str, Any] = {}  # announced; every end is built with them
        self._staging: BucketBuffers | None = None  # reused while the plan stays the same
        self._slice: list[str] = []  # the members this rank sent the last attempt to
        self.sent_bytes = 0    # delivered by this rank since it started: bytes x engines
        self.sent_engines = 0  # and engines (its slice's, with fan-out), as a SliceSender's
        self._phases: dict[str, float] = {}  # seconds per phase of the last attempt (metrics)
        self._store = serve_store(host, cfg.timeout_s)
        self.address = f"{host}:{self._store.port}"
        self._epoch = 0
        self._token = uuid.uuid4().hex[:8]  # group names unique to this broadcaster
        self._group: _Group | None = None
        self._membership = Membership(cfg.timeout_s)
        self._version = -1  # the version being synced (named in eviction reasons)
        self._closed = False

    # --- membership ------------------------------------------------------------------------

    def members(self) -> list[str]:
        """Alive rollout members (not stopped), sorted, minus those not heard from since
        their eviction (and, during a sync, minus those it evicted: they get the next sync,
        not a retry)."""
        now = time.monotonic()  # before the request: a silent member can never look fresh
        return self._membership.roster(self._listed(), now)

    def evictions(self) -> dict[str, str]:
        """Members evicted and not heard from since, each with the reason (safe to call from
        any thread: the learner puts it in its heartbeat, where the monitor shows it)."""
        return self._membership.notes

    def needs_sync(self) -> bool:
        """Did membership change since the last delivery (an engine joined, left or died)?"""
        current = self._group.members if self._group is not None else ()
        return tuple(self.members()) != current

    def _listed(self) -> dict[str, Any]:
        return self._control.status().get("members", {})

    def _lost(self, members: list[str]) -> dict[str, str]:
        """Those of ``members`` that departed or went silent, with the reason: a join, an ack
        or a collective's part from them will not come."""
        engines = [name for name in members if name not in self._sender_names]
        return self._membership.lost(self._listed(), engines, self._version)

    def _await(self, key_of: Callable[[str], str], members: list[str],
               accept: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, str], list[str]]:
        """Wait up to ``timeout_s`` for every member's key to pass ``accept``, but only while
        none of those still missing is lost (then this attempt cannot succeed as planned).
        Returns ``(lost, missing)``: the lost members with the reason, and the others still
        missing when the wait ended (late, if nobody was lost)."""
        by_key = {key_of(name): name for name in members}
        lost: dict[str, str] = {}

        def gone(keys: list[str]) -> list[str]:
            lost.update(self._lost([by_key[key] for key in keys]))
            return list(lost)

        missing = [by_key[key] for key in await_keys(
            self._control, list(by_key), accept, time.monotonic() + self._cfg.timeout_s,
            poll_s=WATCH_S, gone=gone)]
        return lost, [name for name in missing if name not in lost]

    def _evict(self, why: Mapping[str, str]) -> None:
        """Evict each member of ``why`` (member → reason, logged) and drop the group."""
        now = time.monotonic()
        for name, reason in why.items():
            logger.warning("weights: evicted %s: %s", name, reason)
            self._membership.evict(name, reason, now)
        self._drop()

    def _drop(self) -> None:
        if self._group is not None:
            self._group.transport.close()
            self._group = None

    # --- one update ------------------------------------------------------------------------

    def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Deliver ``state_dict`` as ``version`` to every member; returns metrics.

        Raises only if the control plane itself fails; lost or slow engines are evicted."""
        start = time.monotonic()
        self._version = version
        self._phases = {"timing/weight_send": 0.0, "timing/weight_ack": 0.0}
        plan = plan_buckets(state_dict, max(1, int(self._cfg.bucket_mb * 2**20)), self._align,
                            self._alone_bytes())
        state_device = next(iter(state_dict.values())).device if state_dict else None
        self._device = self._learner_device or state_device
        opts = announced_opts(self._cfg.transport, plan.total_bytes, self._sim_sync_s)
        if opts != self._transport_opts:
            self._drop()  # a group's options (sim: its wire speed) are fixed at its creation
            self._transport_opts = opts
        try:
            delivered, attempts = self._deliver(plan, state_dict, version)
        finally:
            evicted = self._membership.sync_ended()
        served = len(set(self._slice) & set(delivered))
        self.sent_bytes += plan.total_bytes * served
        self.sent_engines += served
        return {"timing/weight_sync": time.monotonic() - start,
                "weights/bytes": float(plan.total_bytes if delivered else 0),
                "weights/sent_engines": float(served),  # this rank's slice (fanout)
                "weights/sent_bytes": float(plan.total_bytes * served),
                "weights/members": float(len(delivered)), "weights/evicted": float(evicted),
                "weights/buckets": float(len(plan.bucket_nbytes)),
                "weights/attempts": float(attempts), "weights/epoch": float(self._epoch),
                **self._phases}

    def _alone_bytes(self) -> int:
        """``weights.alone_mb`` in bytes, or 0 (pack every tensor) while the group's transport
        pays per bucket whatever its size (``packs_every_tensor``: ipc). The plan is announced
        before an epoch picks its transport (``auto``), so the first update of a group goes
        by the setting, and the next by the transport it got; any plan suits any transport."""
        if self._group is not None and self._group.transport.packs_every_tensor:
            return 0
        return int(self._cfg.alone_mb * 2**20)

    def _deliver(self, plan: BucketPlan, state: Mapping[str, torch.Tensor],
                 version: int) -> tuple[list[str], int]:
        """Attempts until one reaches every (remaining) member: (members reached, attempts)."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            members = self._roster()
            if not members:
                self._drop()
                return [], attempt - 1
            try:
                delivered = self._attempt(plan, state, version, members)
            except RuntimeError as exc:  # a peer vanished or timed out mid-collective
                logger.warning("weights: version %d epoch %d failed (%s); rebuilding the group",
                               version, self._epoch, str(exc).splitlines()[0][:200])
                self._drop()
                continue
            if delivered:
                return delivered, attempt
        logger.error("weights: version %d reached no engine after %d attempts",
                     version, MAX_ATTEMPTS)
        return [], MAX_ATTEMPTS

    def _roster(self) -> list[str]:
        """The members to send to now. Those already lost are evicted first: an engine that
        froze between two updates is out before anyone waits for it."""
        now = time.monotonic()  # before the request: a silent member can never look fresh
        listed = self._listed()
        members = self._membership.roster(listed, now)
        lost = self._membership.lost(listed, members, self._version)
        if lost:
            self._evict(lost)
        return [name for name in members if name not in lost]

    def _attempt(self, plan: BucketPlan, state: Mapping[str, torch.Tensor], version: int,
                 members: list[str]) -> list[str]:
        """One try over ``members``: the members that have the version (empty when someone
        was lost before the others acked: they get it in the next attempt, at once)."""
        self._slice = slices(members, self._senders)[0]  # whom this rank sends to
        fresh = self._group is None or self._group.members != tuple(members)
        if fresh:
            self._drop()
            self._epoch += 1
        self._announce(plan, version, members)
        if fresh and not self._rendezvous(members):
            return []
        assert self._group is not None
        started = time.monotonic()
        lost = self._send(self._group.transport, plan, state, members)
        if lost:  # a bucket is held up by them: the others cannot have it all
            self._evict(lost)
            return []
        sent = time.monotonic()
        lost, missing = self._wait_acks(members, version)
        self._phases = {"timing/weight_send": sent - started,
                        "timing/weight_ack": time.monotonic() - sent}
        if not lost and missing:  # the wait ran its course: they are late
            lost = {name: f"no ack of version {version} within {self._cfg.timeout_s:.1f} s"
                    for name in missing}
            missing = []
        if lost:
            self._evict(lost)
        return [] if missing else [name for name in members if name not in lost]

    def _send(self, transport: WeightTransport, plan: BucketPlan,
              state: Mapping[str, torch.Tensor], members: list[str]) -> dict[str, str]:
        """Broadcast every bucket, packing bucket i+1 while bucket i is on the wire; returns
        the members found lost while a bucket was held up (empty: every bucket went out).

        Double buffering: bucket i is packed into staging slot i % 2, whose previous user,
        bucket i-2, was waited for before bucket i-1 went out. A send that does not finish
        (a failed ``wait`` raises, a lost member ends it) leaves broadcasts pending that still
        read their staging slots: the staging buffers are let go with the group, and the
        next send packs into new ones.
        """
        if not plan.bucket_nbytes:
            return {}
        device = transport.buffer_device()
        staging = self._staging_for(plan, state, device)
        finished = False
        try:
            pending: Pending | None = None
            for index in range(len(plan.bucket_nbytes)):
                work = transport.send(stage(plan, index, state, staging, device))
                if pending is not None:
                    lost = self._watch(pending, members)
                    if lost:
                        return lost
                pending = work
            lost = self._watch(work, members)
            finished = not lost
            return lost
        finally:
            if not finished:
                self._staging = None

    def _watch(self, pending: Pending, members: list[str]) -> dict[str, str]:
        """Wait for one bucket to go out; while it has not, ask every :data:`WATCH_S` who is
        lost, since a frozen member holds it up until the group's timeout. Returns those
        (the bucket still pending), or nothing once it went out; raises as ``wait`` does."""
        while not pending.wait(WATCH_S):
            lost = self._lost(members)
            if lost:
                return lost
        return {}

    def _staging_for(self, plan: BucketPlan, state: Mapping[str, torch.Tensor],
                     device: torch.device) -> BucketBuffers:
        if not staging_fits(self._staging, plan, state, device):
            self._staging = None  # let the old buffers go before allocating the new ones
            self._staging = new_staging(plan, state, device)
            logger.info("weights: staging buffers for %d buckets on %s: %.1f MB",
                        len(plan.bucket_nbytes), device, self._staging.nbytes / 1e6)
        return self._staging

    def _announce(self, plan: BucketPlan, version: int, members: list[str]) -> None:
        manifest, buckets = plan.to_json()
        self._control.set_key(ANNOUNCE_KEY, {
            "version": version, "epoch": self._epoch, "members": members,
            "store": self.address, "group": group_name(self._token, self._epoch),
            "transport": self._cfg.transport, "transport_opts": self._transport_opts,
            "senders": self._senders,
            "timeout_s": self._cfg.timeout_s, "manifest": manifest, "buckets": buckets})

    def _rendezvous(self, members: list[str]) -> bool:
        """Wait for every member's join (and, with several senders, every other learner
        rank's that has engines to serve), then say go (and create rank 0's group) or no-go.
        No-go evicts who was lost (the others that had not joined yet get the next
        attempt's full wait) or, failing that, who did not join in time; a learner rank that
        did not join fails the attempt without evicting anyone."""
        epoch = self._epoch

        def joined(value: dict[str, Any]) -> bool:
            return value.get("epoch") == epoch and value.get("store") == self.address

        parts = slices(members, self._senders)
        senders = [sender_name(k) for k in range(1, len(parts)) if parts[k]]
        lost, late = self._await(join_key, members + senders, joined)
        late_senders = [name for name in late if name in senders]
        late = [name for name in late if name not in senders]
        go = not lost and not late and not late_senders
        transports = self._choose(parts) if go else []
        self._control.set_key(GROUP_KEY, {"epoch": epoch, "store": self.address, "go": go,
                                          "transport": transports[0] if transports else "",
                                          "transports": transports})
        if late_senders and not lost and not late:
            logger.error("weights: learner ranks %s did not join epoch %d within %.1f s",
                         late_senders, epoch, self._cfg.timeout_s)
        if not go:
            if lost or late:
                self._evict(lost or {name: f"did not join epoch {epoch} within "
                                           f"{self._cfg.timeout_s:.1f} s" for name in late})
            return False
        transport = make_transport(transports[0], host=self._host,
                                   timeout_s=self._cfg.timeout_s, device=self._device,
                                   **self._transport_opts)
        transport.connect(self._store, slice_group(group_name(self._token, epoch),
                                                   self._senders, 0), 0, len(parts[0]) + 1)
        self._group = _Group(epoch, tuple(members), transport)
        self.transport = transports[0]
        logger.info("weights: epoch %d with %d engines over %s (this rank serves %d): %s",
                    epoch, len(members), transports, len(parts[0]), members)
        return True

    def _choose(self, parts: list[list[str]]) -> list[str]:
        """Each slice's transport (``weights.transport``, or for ``auto`` the one the devices
        its sender and its engines reported call for: :func:`choose_transport`)."""
        senders = [sender_name(k) for k in range(1, len(parts))]
        names = [name for part in parts for name in part] + senders
        joins = {key: value for key, (_, value) in
                 self._control.get_keys([join_key(name) for name in names]).items()}

        def device(name: str) -> str:
            return str(joins.get(join_key(name), {}).get("device", "cpu"))

        chosen = []
        for index, part in enumerate(parts):
            own = describe_device(self._device) if index == 0 else device(senders[index - 1])
            chosen.append(choose_transport(self._cfg.transport, own, [device(m) for m in part]))
        return chosen

    def _wait_acks(self, members: list[str],
                   version: int) -> tuple[dict[str, str], list[str]]:
        """``(lost, missing)``: members lost before acking ``version`` in this epoch, and the
        others that had not acked it when the wait ended (see :meth:`_await`)."""
        epoch = self._epoch

        def acked(value: dict[str, Any]) -> bool:
            return (value.get("version", -1) >= version and value.get("epoch") == epoch
                    and value.get("store") == self.address)

        return self._await(ack_key, members, acked)

    def close(self) -> None:
        """Tell receivers to leave (an announcement without members), drop the group, stop
        the store. No barrier: a receiver may be gone, and an idle one needs none."""
        if self._closed:
            return
        self._closed = True
        try:
            self._control.set_key(ANNOUNCE_KEY, {"version": -1, "epoch": self._epoch + 1,
                                                 "members": [], "store": self.address,
                                                 "closed": True})
        except (TimeoutError, RuntimeError) as exc:
            logger.warning("weights: could not announce the close: %s", exc)
        self._drop()
        self._staging = None
        del self._store  # the store server stops with its last reference
