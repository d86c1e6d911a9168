"""The ``gloo`` weight transport: a standalone gloo group over the epoch's store, on CPU.

The group lives beside the learners' world (a standalone process group over the broadcaster's
own ``TCPStore``), so rollout processes never join the learners' ``init_process_group``, and
it stays out of torch's global registry (no default group needed, no name clashes, nothing to
unregister).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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

    def send(self, flat: torch.Tensor) -> dist.Work:
        return self._broadcast(flat)

    def receive(self, flat: torch.Tensor) -> dist.Work:
        return self._broadcast(flat)

    def _broadcast(self, flat: torch.Tensor) -> dist.Work:
        """Broadcast ``flat`` in place from rank 0, returning at once; ``wait()`` raises on the
        group's timeout or a lost peer."""
        assert self.group is not None, "connect first"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.group.broadcast([flat], opts)

    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def close(self) -> None:
        """``abort`` closes the connections, so a live peer blocked in a collective of this
        group fails at once instead of waiting out its timeout."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            group.abort()
        except RuntimeError as exc:  # already broken: the connections are gone either way
            logger.debug("abort of a broken weight group: %s", exc)
