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

The transports: ``gloo`` and ``nccl`` are one code path (:mod:`asyncrl.weights.group`: a
torch process group over the epoch's store, every wait bounded by a watchdog) that differs
only in the backend it builds and the device of its buffers, so CI runs the NCCL path through
gloo; ``ipc`` (:mod:`asyncrl.weights.ipc`) hands CUDA IPC handles of rank 0's packed buckets
to engines on the same GPU, which copy device to device; ``sim`` waits instead of sending.
``auto`` is not a transport but a rule: :func:`choose_transport` picks one per epoch from the
devices rank 0 and the members reported in the handshake.

To add a transport: one module with one class that has the five methods of
:class:`WeightTransport` and the two class-level members of :class:`TransportClass`, its name
in :func:`transport_class`, :data:`TRANSPORT_KINDS` and ``weights.transport``'s choices. Only
this module knows the names; the broadcaster, the receiver and the config checks ask the
descriptor (:func:`transport_kind`) or the object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    all of an update's at once).

    ``packs_every_tensor``: True where a bucket costs a fixed overhead whatever its size
    (ipc), so that the broadcaster packs every tensor into buckets, ``weights.alone_mb``
    aside, once such a group exists."""

    packs_every_tensor: bool

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

    def __call__(self, *, host: str, timeout_s: float, device: torch.device | None = None,
                 **opts: Any) -> WeightTransport:
        """An unconnected end: ``host`` is the address it binds (``weights.host``),
        ``timeout_s`` bounds every wait of the group, ``device`` is where this end's buckets
        live (the learner's or the engine's; None: the transport's default), ``opts`` are the
        announced options."""

    def announced_opts(self, update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        """The options rank 0 announces for an update of ``update_bytes`` (every end is built
        with them); ``sim_sync_s``: what one whole update should take, for a simulated wire."""


@dataclass(frozen=True)
class TransportKind:
    """What the config checks and the handshake need to know of a transport, torch-free."""

    needs_cuda: bool  # both ends' buckets on CUDA: refused on a machine without it
    torch_backend: str | None  # the process-group backend a peer server joins with (SGLang)


TRANSPORT_KINDS: dict[str, TransportKind] = {
    "auto": TransportKind(needs_cuda=False, torch_backend=None),
    "gloo": TransportKind(needs_cuda=False, torch_backend="gloo"),
    "nccl": TransportKind(needs_cuda=True, torch_backend="nccl"),
    "ipc": TransportKind(needs_cuda=True, torch_backend=None),
    "sim": TransportKind(needs_cuda=False, torch_backend=None),
}
CPU = "cpu"  # a device description (:func:`describe_device`) that is not a GPU


def transport_kind(name: str) -> TransportKind:
    """The descriptor of ``weights.transport = name``."""
    try:
        return TRANSPORT_KINDS[name]
    except KeyError:
        raise NotImplementedError(
            f"weight transport {name!r} ({' | '.join(TRANSPORT_KINDS)})") from None


def missing_cuda(name: str) -> str | None:
    """The start-up error of ``weights.transport = name`` on a machine without CUDA, or None.
    Imports torch: call it from the start-up checks, not from the config."""
    if not transport_kind(name).needs_cuda:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (f"weights.transport: {name!r} needs CUDA, but this machine sees no CUDA device "
            f"(torch {torch.__version__}); use 'auto' or 'gloo'")


def describe_device(device: torch.device | None) -> str:
    """How an end names its device in the handshake: ``"cpu"``, or ``"cuda:<uuid>"`` so that
    two processes can tell whether they share a physical GPU whatever their
    ``CUDA_VISIBLE_DEVICES`` numbering."""
    if device is None or device.type != "cuda":
        return CPU
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def choose_transport(name: str, learner: str, members: Sequence[str]) -> str:
    """The transport of one epoch: ``name`` itself unless it is ``auto``. ``auto``: ``ipc``
    when rank 0 (``learner``, a :func:`describe_device`) and every member share one GPU,
    ``nccl`` when all are on GPUs and none shares rank 0's (NCCL refuses two ranks on one
    device), ``gloo`` otherwise (a CPU end, or a fleet that mixes both)."""
    if name != "auto":
        return name
    if learner == CPU or not members or CPU in members:
        return "gloo"
    if all(member == learner for member in members):
        return "ipc"
    if learner not in members:
        return "nccl"
    return "gloo"


def announced_opts(name: str, update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
    """What rank 0 announces for ``weights.transport = name`` (``auto``: nothing, since the
    transports it picks from take no options)."""
    if name == "auto":
        return {}
    return transport_class(name).announced_opts(update_bytes, sim_sync_s)


def transport_class(name: str) -> TransportClass:
    """The transport ``name`` names (not ``auto``: see :func:`choose_transport`)."""
    if name == "gloo":
        from asyncrl.weights.group import GlooTransport

        return GlooTransport
    if name == "nccl":
        from asyncrl.weights.group import NcclTransport

        return NcclTransport
    if name == "ipc":
        from asyncrl.weights.ipc import IpcTransport

        return IpcTransport
    if name == "sim":
        from asyncrl.weights.sim import SimTransport

        return SimTransport
    raise NotImplementedError(f"weight transport {name!r} (gloo, nccl, ipc or sim)")


def make_transport(name: str, *, host: str, timeout_s: float,
                   device: torch.device | None = None, **opts: Any) -> WeightTransport:
    """An unconnected end of transport ``name`` (the epoch's, from the handshake), built with
    the announcement's ``transport_opts``, its buckets on ``device``."""
    return transport_class(name)(host=host, timeout_s=timeout_s, device=device, **opts)
