"""Rollout side of the weight sync: :class:`WeightReceiver`, one background thread per engine.

It follows the announcements of :class:`asyncrl.weights.broadcaster.WeightBroadcaster` (the
format and handshake are documented there), joins the epoch's group over the announced
transport (:mod:`asyncrl.weights.transport`), receives every bucket, hands the named tensors
to ``apply`` (the engine's ``load_weights``) and acks. Every wait is bounded, so a lost
learner or a broken group costs one timeout, after which the next announcement is served;
``stop`` is seen within a long-poll slice except during a transfer.

A frozen peer (a SIGSTOPped engine: alive, but silent) holds up the group's broadcasts, and
with them this end, until the group's timeout, while the broadcaster has evicted it and goes
on without it in a new epoch. So a bucket that takes longer than :data:`WATCH_S` makes the
receiver look for a newer announcement: one means the broadcaster gave up on this group (it
evicted someone, or it closed), and the receiver leaves the group at once and serves that
announcement, without applying anything of the abandoned update.

Receive buffers are a pool reused across updates (one slot per bucket, rebuilt when the plan
changes, dropped when the group is): fresh ones page-fault on every byte. All of an update's
broadcasts are posted at once, so bucket *i+1* lands while bucket *i* is unpacked. ``apply`` is
called once, after the last bucket, with every tensor of the update: one call is the commit,
so an engine never generates with half of a new version, and its pause (the time it holds
its own lock) is the commit alone, not the transfer.

An update the engine refuses (a name or shape its model lacks:
:class:`~asyncrl.weights.fit.WeightsRefused`) ends the service: the learner's model is not this
engine's, and every later update would be refused the same way. The receiver leaves the group
without acking (the broadcaster evicts it) and keeps the error in :attr:`WeightReceiver.refused`
for the rollout worker, which stops on it. Any other failure leaves the group and serves the
next announcement: a lost peer or a broken group mends itself.

Two kinds of commit. By default ``apply`` gets views into the pool, valid only until it
returns, and copies them into the engine (``load_weights``): the pause is one memcpy of the
model. With ``adopt=True`` the receiver keeps TWO pools and alternates them, so the tensors
``apply`` gets stay untouched until the update after next; the engine may then make them its
parameters without a copy (``TorchEngine.adopt_weights``: a pointer swap per tensor). The
update after next lands in the other pool, which by then the engine has let go of (it adopted
the next update's). Memory: two pools, the engine's original parameters are released by its
first adoption, so about the same as one pool plus the model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.control_plane import BufferStopped, ControlPlane
from asyncrl.weights.fit import WeightsRefused
from asyncrl.weights.plan import BucketBuffers, BucketPlan, unpack_bucket
from asyncrl.weights.rendezvous import (
    ANNOUNCE_KEY,
    GROUP_KEY,
    ack_key,
    await_key,
    dial_store,
    join_key,
)
from asyncrl.weights.slices import Seat, seat
from asyncrl.weights.transport import WeightTransport, describe_device, make_transport

logger = logging.getLogger(__name__)

Apply = Callable[[dict[str, torch.Tensor], int], None]
WATCH_S = 1.0  # a bucket this late makes the receiver check that its update is still on


class Superseded(RuntimeError):
    """A newer announcement came during a transfer: the broadcaster gave up on this group."""


class WeightReceiver:
    """Receives weight updates for ``member`` on a daemon thread and calls ``apply``.

    ``control`` must be a client of its own: only the receiver's thread uses it (clients are
    not thread-safe), so the caller opens one for it, and closes it after :meth:`stop`.
    ``apply(named, version)`` is called once per update with every tensor of it; the tensors
    view reused receive buffers, so they are valid only until ``apply`` returns (copy what you
    keep), unless ``adopt``: then they stay valid until ``apply`` is called with the next
    update, so the engine may keep them as its weights. ``host`` is the address this end of
    the group binds (``weights.host``). ``device``: the engine's device, where the buckets
    land when the epoch's transport can put them there (``nccl``, ``ipc``); it is reported in
    the handshake so that ``weights.transport = "auto"`` can pick the transport.
    """

    def __init__(self, control: ControlPlane, member: str, apply: Apply,
                 host: str = "127.0.0.1", poll_s: float = 0.25, adopt: bool = False,
                 device: torch.device | None = None) -> None:
        self.member = member
        self.device = device
        self._control = control
        self._apply = apply
        self._host = host
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._version_cv = threading.Condition()
        self._last_version = -1
        self._refused: WeightsRefused | None = None
        self._seq = 0  # sequence number of the last announcement handled
        self._transport: WeightTransport | None = None  # this end of the epoch's group
        self._group_id: tuple[str, int] | None = None  # (store, epoch) of self._transport
        self._store: dist.TCPStore | None = None
        self._adopt = adopt
        # receive buffers, reused while the plan holds; two when the engine adopts tensors
        self._pools: list[BucketBuffers | None] = [None, None] if adopt else [None]
        self._serving = threading.Lock()  # held while an update is served: the pools in use
        self._next_pool = 0  # adopt: the pool the engine does not hold
        self._pool_sizes: set[tuple[int, int, str]] = set()  # (pool, bytes, device) logged
        self._thread = threading.Thread(target=self._run, name=f"weights-{member}", daemon=True)

    @property
    def last_version(self) -> int:
        """Version of the last update applied and acked (-1 before the first)."""
        with self._version_cv:
            return self._last_version

    @property
    def refused(self) -> WeightsRefused | None:
        """Why the engine refused an update, once it did; the receiver serves no more."""
        with self._version_cv:
            return self._refused

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Block until ``last_version >= version``; False after ``timeout`` seconds, or at
        once when the engine refuses an update (:attr:`refused`)."""
        with self._version_cv:
            self._version_cv.wait_for(
                lambda: self._last_version >= version or self._refused is not None, timeout)
            return self._last_version >= version

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to end and join it (within a poll slice unless mid-transfer)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("weights: receiver %s still busy after %.1fs", self.member,
                               timeout)

    # --- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self._control.get_key(ANNOUNCE_KEY, newer_than=self._seq,
                                            timeout_s=self._poll_s)
                if got is not None:
                    self._seq, announcement = got
                    with self._serving:
                        self._serve(announcement)
            except BufferStopped:  # the role is stopping, and its broker does not answer
                break
            except TimeoutError as exc:  # the buffer did not answer (yet): one line, not a trace
                logger.warning("weights: receiver %s left its group: %s", self.member, exc)
                self._leave()
            except WeightsRefused as exc:  # the learner's model is not this engine's: final
                logger.error("weights: %s refused an update and takes no more: %s",
                             self.member, exc)
                with self._version_cv:
                    self._refused = exc
                    self._version_cv.notify_all()
                break
            except RuntimeError as exc:  # group or store: a peer is gone or the epoch moved on
                logger.warning("weights: receiver %s left its group: %s", self.member,
                               str(exc).splitlines()[0][:200] if str(exc) else repr(exc))
                self._leave()
            except Exception:  # noqa: BLE001 - keep serving; the next announcement may work
                logger.exception("weights: receiver %s failed; leaving the group", self.member)
                self._leave()
        self._leave()

    def _serve(self, ann: dict[str, Any]) -> None:
        members = ann.get("members", [])
        if self.member not in members:
            self._leave()  # evicted, or the broadcaster closed
            return
        group_id = (ann["store"], int(ann["epoch"]))
        if self._group_id != group_id:
            self._leave()
            if not self._join(ann, seat(ann, self.member)):
                return
        version = int(ann["version"])
        named = self._receive(BucketPlan.from_json(ann["manifest"], ann["buckets"]))
        self._apply(named, version)
        if self._adopt:  # the engine holds this pool now: the next update uses the other
            self._next_pool = 1 - self._next_pool
        with self._version_cv:
            self._last_version = version
            self._version_cv.notify_all()
        self._control.set_key(ack_key(self.member), {"version": version, "epoch": group_id[1],
                                                     "store": group_id[0]})

    def _join(self, ann: dict[str, Any], place: Seat) -> bool:
        """The epoch handshake, then the group of this engine's slice (the learner rank that
        serves it is the group's rank 0). False if the epoch went on without us."""
        decision = self._handshake(ann)
        if decision is None:
            return False
        self._connect(ann, decision, place)
        return True

    def _connect(self, ann: dict[str, Any], decision: dict[str, Any], place: Seat) -> None:
        """This process's end of its slice's group, over the transport the go decided."""
        store, epoch, timeout_s = ann["store"], int(ann["epoch"]), float(ann["timeout_s"])
        self._store = dial_store(store, timeout_s)
        name = agreed_transport(ann, decision, place.slice)
        transport = make_transport(name, host=self._host, timeout_s=timeout_s,
                                   device=self.device, **ann.get("transport_opts", {}))
        transport.connect(self._store, place.group, place.rank, place.world)
        self._transport, self._group_id = transport, (store, epoch)
        logger.info("weights: %s joined epoch %d as rank %d/%d of %s over %s", self.member,
                    epoch, place.rank, place.world, place.group, name)

    def _handshake(self, ann: dict[str, Any]) -> dict[str, Any] | None:
        """Join → go through the control plane, before anyone creates the epoch's group; the
        join says which device this end's buckets would live on. The go decision (it names
        the epoch's transport), or None if the epoch went on without us (stale announcement,
        no-go, or no answer in time). Shared with peers whose group member is another
        process (SGLang)."""
        store, epoch, timeout_s = ann["store"], int(ann["epoch"]), float(ann["timeout_s"])
        current = self._control.get_key(GROUP_KEY, 0, 0.0)
        if current is not None and current[1].get("store") == store \
                and current[1].get("epoch", -1) >= epoch:
            logger.info("weights: %s skips epoch %d, already decided", self.member, epoch)
            return None
        self._control.set_key(join_key(self.member), {"epoch": epoch, "store": store,
                                                      "device": describe_device(self.device)})
        decision = await_key(
            self._control, GROUP_KEY,
            lambda v: v.get("store") == store and v.get("epoch", -1) >= epoch,
            time.monotonic() + 2 * timeout_s, current[0] if current else 0, self._stop,
            self._poll_s)
        go = decision is not None and decision.get("epoch") == epoch and bool(decision.get("go"))
        return decision if go else None

    def _receive(self, plan: BucketPlan) -> dict[str, torch.Tensor]:
        """Every bucket into the pool: all receives are posted first (they complete in
        order), then each is waited for and unpacked while the next ones arrive."""
        transport = self._transport
        assert transport is not None
        pool = self._pool_for(plan, transport.buffer_device())
        buffers = [pool.slot(index) for index in range(len(plan.bucket_nbytes))]
        works = [transport.receive(flat) for flat in buffers]
        named: dict[str, torch.Tensor] = {}
        for index, (work, flat) in enumerate(zip(works, buffers)):
            while not work.wait(WATCH_S):
                if self._control.get_key(ANNOUNCE_KEY, newer_than=self._seq) is not None:
                    raise Superseded("a newer announcement came during the transfer")
            named.update(unpack_bucket(plan, index, flat))
        return named

    def _pool_for(self, plan: BucketPlan, device: torch.device) -> BucketBuffers:
        index = self._next_pool
        pool = self._pools[index]
        if pool is None or not pool.fits(plan, device):
            self._pools[index] = None  # let the old buffers go before allocating the new ones
            pool = self._pools[index] = BucketBuffers(plan, device,
                                                      slots=len(plan.bucket_nbytes))
            # once per size: a sleeping engine (launcher.colocate) lets go of its pools at
            # every step and allocates the same again at the next update
            size = (index, pool.nbytes, str(device))
            level = logging.DEBUG if size in self._pool_sizes else logging.INFO
            self._pool_sizes.add(size)
            logger.log(level, "weights: %s receive pool %d for %d buckets: %.1f MB",
                       self.member, index, len(plan.bucket_nbytes), pool.nbytes / 1e6)
        return pool

    @property
    def buffer_bytes(self) -> int:
        """Bytes held in receive pools now (0 after :meth:`release_buffers`)."""
        return sum(pool.nbytes for pool in list(self._pools) if pool is not None)

    def release_buffers(self, timeout_s: float) -> bool:
        """Let go of the receive pools now (from another thread): an engine going to sleep
        (``launcher.colocate``) gives its device memory back, and with an ``ipc`` or
        ``nccl`` group the pools are on the device. Waits for an update being served to end,
        up to ``timeout_s`` (False then, nothing released). The next update allocates new
        pools; an adopting engine must hold none of these tensors any more (asleep, its
        weights are in host copies)."""
        if not self._serving.acquire(timeout=timeout_s):
            return False
        try:
            on_cuda = any(p is not None and p.device.type == "cuda" for p in self._pools)
            self._pools = [None] * len(self._pools)
            if on_cuda:
                torch.cuda.empty_cache()
            return True
        finally:
            self._serving.release()

    def _leave(self) -> None:
        """Drop the group (aborting any broadcast still pending into the pool) and the pool
        with it, so that no aborted receive can write into buffers a later update reads."""
        if self._transport is not None:
            self._transport.close()
        self._transport, self._group_id, self._store = None, None, None
        self._pools = [None] * len(self._pools)  # an adopted pool lives on in the engine


def agreed_transport(ann: dict[str, Any], decision: dict[str, Any], index: int = 0) -> str:
    """The transport of slice ``index``'s group: the go decision's (``weights.transport =
    "auto"`` is decided there per slice, from the devices the joins reported), else the
    announcement's."""
    transports = decision.get("transports") or []
    if index < len(transports):
        return str(transports[index])
    return str(decision.get("transport") or ann["transport"])
