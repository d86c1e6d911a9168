"""How the bytes of a weight update travel: the :class:`WeightTransport` protocol and its factory.

Everything else of the weight sync is the same whatever carries the bytes: the announcement,
the bucket plan, the membership epochs and their join → go handshake, the acks, eviction and
timeouts (:mod:`asyncrl.weights.broadcaster`, :mod:`asyncrl.weights.receiver`). A transport
is only one end of one epoch's group and the device its buckets live on.

One update, as the transports see it. The broadcaster (rank 0) asks its transport class what
to announce (:meth:`TransportClass.announced_opts`) and announces
``{"transport": name, "transport_opts": opts}``; after the handshake's go, it and every
receiver build their end with ``make_transport(name, host=..., timeout_s=..., **opts)`` and
:meth:`~WeightTransport.connect` it; rank 0 then :meth:`~WeightTransport.send` s each bucket
in plan order while the others :meth:`~WeightTransport.receive` into buffers on
:meth:`~WeightTransport.buffer_device`; a new epoch, an eviction or a failure ends the group
with :meth:`~WeightTransport.close`.

To add a transport (NCCL, CUDA IPC): one module with one class that has the five methods of
:class:`WeightTransport` and the two class-level members of :class:`TransportClass`, its name
in :func:`transport_class` and in ``weights.transport``'s choices. Only :func:`transport_class`
knows the names; the broadcaster and the receiver ask the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class Pending(Protocol):
    """A bucket posted to the group."""

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the bucket went out (rank 0) or arrived (the others); False if it still
        has not after ``timeout_s`` seconds (None: no limit but the group's), so that the
        caller can look around (who is lost? is the update still on?) and wait again.
        Raises on the group's timeout or a lost peer."""


class WeightTransport(Protocol):
    """One end of one membership epoch's broadcast group: rank 0 sends, the others receive.

    Collectives of one group match by issue order, so every end posts its buckets in plan
    order. A posted bucket's tensor must stay untouched until its :meth:`Pending.wait`
    returns; at most a few are in flight (the broadcaster double-buffers, a receiver posts
    all of an update's at once)."""

    def connect(self, store: dist.Store | None, group: str, rank: int, world: int) -> None:
        """Join the group named ``group`` over the epoch's ``store`` as ``rank`` of ``world``;
        blocks until every rank joined, or raises after the transport's timeout."""

    def send(self, flat: torch.Tensor) -> Pending:
        """Rank 0: start sending one bucket (a flat ``uint8`` tensor) to every other rank."""

    def receive(self, flat: torch.Tensor) -> Pending:
        """Rank >= 1: start receiving the next bucket into ``flat`` (its exact size)."""

    def buffer_device(self) -> torch.device:
        """Where receive buffers must live for this transport (NCCL would need CUDA)."""

    def close(self) -> None:
        """Let go of the group without a barrier and without waiting for a bucket still
        pending (a frozen peer holds it until the group's timeout). Such a bucket's buffer may
        still be read (rank 0) or written (the others) until it fails: the caller must not
        reuse it. Idempotent, and safe before :meth:`connect` or after it failed."""


class TransportClass(Protocol):
    """What :func:`transport_class` returns: the class of one transport."""

    def __call__(self, *, host: str, timeout_s: float, **opts: Any) -> WeightTransport:
        """An unconnected end: ``host`` is the address it binds (``weights.host``),
        ``timeout_s`` bounds every wait of the group, ``opts`` are the announced options."""

    def announced_opts(self, update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        """The options rank 0 announces for an update of ``update_bytes`` (every end is built
        with them); ``sim_sync_s``: what one whole update should take, for a simulated wire."""


def transport_class(name: str) -> TransportClass:
    """The transport ``weights.transport`` names; the only code that knows the names."""
    if name == "gloo":
        from asyncrl.weights.gloo import GlooTransport

        return GlooTransport
    if name == "sim":
        from asyncrl.weights.sim import SimTransport

        return SimTransport
    raise NotImplementedError(f"weight transport {name!r} (gloo or sim)")


def make_transport(name: str, *, host: str, timeout_s: float, **opts: Any) -> WeightTransport:
    """An unconnected end of transport ``name`` (an announcement's ``transport``), built with
    the announcement's ``transport_opts``."""
    return transport_class(name)(host=host, timeout_s=timeout_s, **opts)
