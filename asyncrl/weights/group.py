"""The ``gloo`` and ``nccl`` weight transports: one standalone torch process group over the
epoch's store, the same code for both. They differ only in the backend object
:meth:`GroupTransport._backend` builds (``ProcessGroupGloo`` on CPU buffers,
``ProcessGroupNCCL`` on CUDA buffers) and the key prefix torch gives that backend; the
broadcast, the bounded waits, the watchdog (:mod:`asyncrl.weights.watchdog`) and the release
are shared, so CI tests the NCCL path by running gloo. NCCL between two processes needs two
GPUs; it has not run on these machines (one GPU at most).

The group lives beside the learners' world (a standalone process group over the broadcaster's
own ``TCPStore``), so rollout processes never join the learners' ``init_process_group``, and
it stays out of torch's global registry (no default group needed, no name clashes, nothing to
unregister).

What a stopped (SIGSTOPped) peer does to a gloo group, measured with torch 2.13: a send to it
waits for its receive to be posted, so rank 0's broadcast of every bucket that reaches it
blocks until the group's timeout; the group's two worker threads are then both blocked, so
the buckets after them reach nobody, and a peer that receives from the stopped one in the
broadcast's binomial tree waits as long. ``abort()`` does not end those collectives, and the
group's destructor waits for them (without holding the interpreter lock). Hence
:meth:`GroupTransport.close` lets the group go on a thread of its own, and
:meth:`GroupPending.wait` takes a timeout, so that both ends can give up on a frozen peer
early (the broadcaster evicts it, the receivers follow the next announcement).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weights.watchdog import Watchdog, Watched

logger = logging.getLogger(__name__)

# Groups being let go on threads of their own, with how long each may still take (its timeout).
# The process waits for them at exit: a thread still inside a group's destructor when the
# interpreter finalizes is killed there, and that aborts the process ("terminate called
# without an active exception") instead of letting it exit with its own status.
_releasing: dict[threading.Thread, float] = {}


@atexit.register
def _wait_for_releases() -> None:
    for thread, timeout_s in list(_releasing.items()):
        thread.join(timeout_s)


class GroupPending:
    """A posted broadcast; see :class:`asyncrl.weights.transport.Pending`. Completion is
    signalled by the work's future (for NCCL: once its CUDA work finished), so a bounded wait
    costs no polling; the group's watchdog settles it as failed past ``weights.timeout_s``."""

    def __init__(self, work: dist.Work, watched: Watched, watchdog: Watchdog) -> None:
        self.work = work
        self._watched = watched

        def finished(_: object) -> None:
            watched.settled.set()
            watchdog.poke()

        work.get_future().add_done_callback(finished)

    def wait(self, timeout_s: float | None = None) -> bool:
        if not self._watched.settled.wait(timeout_s):
            return False
        if self._watched.expired is not None:
            raise RuntimeError(self._watched.expired)
        self.work.wait()  # raises if the broadcast failed
        return True


class GroupTransport:
    """One end of one epoch's process group; see
    :class:`asyncrl.weights.transport.WeightTransport`. Subclasses name the backend.

    ``group`` is the bare backend once connected (``bench/weight_sync.py`` compares the sync
    against raw broadcasts over it)."""

    DEVICE_PREFIX = "cpu"  # the key prefix torch gives this backend's store (its device type)
    packs_every_tensor = False  # a large tensor is one collective from its own memory

    def __init__(self, *, host: str, timeout_s: float, device: torch.device | None = None) -> None:
        self._host = host
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._device = self._buffer_device(device)
        self.group: Any = None
        self._watchdog: Watchdog | None = None

    @staticmethod
    def announced_opts(update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        return {}

    def connect(self, store: dist.Store | None, group: str, rank: int, world: int) -> None:
        """The store keys follow the layout of SGLang's ``init_custom_process_group`` (also
        vLLM's and OpenRLHF's): ``PrefixStore(group, store)`` handed to torch's
        ``_new_process_group_helper``, which adds ``PrefixStore(f"{group}/")`` and, per device
        backend, ``PrefixStore("cpu/")`` for gloo. Building the same chain here lets an SGLang
        server (rank >= 1 via ``/init_weights_update_group``) meet our ranks in one group."""
        keys = dist.PrefixStore(f"{self.DEVICE_PREFIX}/", dist.PrefixStore(
            f"{group}/", dist.PrefixStore(group, store)))
        self.group = self._backend(keys, rank, world)
        self._watchdog = Watchdog(self._timeout.total_seconds(), self._abort, group)

    def _backend(self, keys: dist.Store, rank: int, world: int) -> Any:
        raise NotImplementedError

    def _buffer_device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _abort(self) -> None:
        """The watchdog's way out of a collective that will not finish."""
        group = self.group
        if group is not None:
            group.abort()

    def send(self, flat: torch.Tensor) -> GroupPending:
        return self._broadcast(flat)

    def receive(self, flat: torch.Tensor) -> GroupPending:
        return self._broadcast(flat)

    def _broadcast(self, flat: torch.Tensor) -> GroupPending:
        """Broadcast ``flat`` in place from rank 0, returning at once; ``wait()`` raises on the
        group's timeout, the watchdog's, or a lost peer."""
        assert self.group is not None and self._watchdog is not None, "connect first"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        watched = self._watchdog.watch()
        return GroupPending(self.group.broadcast([flat], opts), watched, self._watchdog)

    def buffer_device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Drop the group on a thread of its own: its destructor waits for the collectives
        still pending, which a frozen peer holds until the group's timeout. ``abort`` first,
        for torch versions where it ends them at once (2.13 does not)."""
        group, self.group = self.group, None
        if self._watchdog is not None:
            self._watchdog.close()
        if group is None:
            return
        try:
            group.abort()
        except RuntimeError as exc:  # already broken: the connections are gone either way
            logger.debug("abort of a broken weight group: %s", exc)
        held = [group]  # the thread drops the last reference, so the destructor runs there
        del group

        def release() -> None:
            held.clear()
            _releasing.pop(threading.current_thread(), None)

        thread = threading.Thread(target=release, name="weights-group-release", daemon=True)
        _releasing[thread] = self._timeout.total_seconds()
        thread.start()


class GlooTransport(GroupTransport):
    """``gloo``: buckets in host memory, TCP between the ends."""

    def _backend(self, keys: dist.Store, rank: int, world: int) -> dist.ProcessGroupGloo:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        opts._timeout = self._timeout
        return dist.ProcessGroupGloo(keys, rank, world, opts)


class NcclTransport(GroupTransport):
    """``nccl``: buckets in CUDA memory on each end's own GPU (two ends cannot share one)."""

    DEVICE_PREFIX = "cuda"

    def _buffer_device(self, device: torch.device | None) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("weights.transport 'nccl' needs CUDA, and this process sees none")
        if device is None or device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _backend(self, keys: dist.Store, rank: int, world: int) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        torch.cuda.set_device(self._device)  # NCCL binds this end's communicator to it
        return dist.ProcessGroupNCCL(keys, rank, world, opts)
