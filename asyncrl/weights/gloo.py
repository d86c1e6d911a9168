"""The ``gloo`` weight transport: a standalone gloo group over the epoch's store, on CPU.

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
:meth:`GlooTransport.close` lets the group go on a thread of its own, and
:meth:`GlooPending.wait` takes a timeout, so that both ends can give up on a frozen peer
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


class GlooPending:
    """A posted broadcast; see :class:`asyncrl.weights.transport.Pending`. Completion is
    signalled by the work's future, so a bounded wait costs no polling."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self._done = threading.Event()
        work.get_future().add_done_callback(lambda _: self._done.set())

    def wait(self, timeout_s: float | None = None) -> bool:
        if timeout_s is not None and not self._done.wait(timeout_s):
            return False
        self.work.wait()  # raises if the broadcast failed
        return True


class GlooTransport:
    """One end of one epoch's gloo group; see :class:`asyncrl.weights.transport.WeightTransport`.

    ``group`` is the bare ``ProcessGroupGloo`` once connected (``bench/weight_sync.py``
    compares the sync against raw broadcasts over it)."""

    def __init__(self, *, host: str, timeout_s: float) -> None:
        self._host = host
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.group: dist.ProcessGroupGloo | None = None

    @staticmethod
    def announced_opts(update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        return {}

    def connect(self, store: dist.Store | None, group: str, rank: int, world: int) -> None:
        """The store keys follow the layout of SGLang's ``init_custom_process_group`` (also
        vLLM's and OpenRLHF's): ``PrefixStore(group, store)`` handed to torch's
        ``_new_process_group_helper``, which adds ``PrefixStore(f"{group}/")`` and, per device
        backend, ``PrefixStore("cpu/")`` for gloo. Building the same chain here lets an SGLang
        server (rank >= 1 via ``/init_weights_update_group``) meet our ranks in one group."""
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        opts._timeout = self._timeout
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group}/",
                                                         dist.PrefixStore(group, store)))
        self.group = dist.ProcessGroupGloo(keys, rank, world, opts)

    def send(self, flat: torch.Tensor) -> GlooPending:
        return self._broadcast(flat)

    def receive(self, flat: torch.Tensor) -> GlooPending:
        return self._broadcast(flat)

    def _broadcast(self, flat: torch.Tensor) -> GlooPending:
        """Broadcast ``flat`` in place from rank 0, returning at once; ``wait()`` raises on the
        group's timeout or a lost peer."""
        assert self.group is not None, "connect first"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return GlooPending(self.group.broadcast([flat], opts))

    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def close(self) -> None:
        """Drop the group on a thread of its own: its destructor waits for the collectives
        still pending, which a frozen peer holds until the group's timeout. ``abort`` first,
        for torch versions where it ends them at once (2.13 does not)."""
        group, self.group = self.group, None
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
