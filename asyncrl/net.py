"""Addresses a role picks for itself: a free port, the interface the rest of the run reaches.

Not learner- or rollout-specific: the launchers pick the learners' rendezvous port, and both
ends of the weight broadcast bind ``weights.host``. No torch here.
"""

from __future__ import annotations

import logging
import socket

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Racy by nature: another process may take it before its server binds it. A port a server of
    ours binds later is a :class:`ReservedPort`; this is for a server that binds at once.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ReservedPort:
    """A free TCP port (``port``), kept from every other process until :meth:`close`, for a
    server started meanwhile (the learners' rendezvous: torch's TCPStore on rank 0). As a
    context manager it gives the port and closes on exit.

    A socket bound to the port on all interfaces with ``SO_REUSEADDR``, never listening, holds
    it: the kernel gives the port to no other ``bind(0)`` and to no outgoing connection, and a
    plain bind of it fails, yet a server that binds it with ``SO_REUSEADDR`` (TCPStore and
    ZMQ do) may listen on it. :func:`free_port` closes its socket before the server binds,
    seconds later when the ranks start under load: in CI another process took the port in
    between and the rendezvous failed with EADDRINUSE.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("", 0))
        self.port = int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.close()


def broadcast_host(cfg, address: str | None) -> str:
    """``weights.host`` resolved: ``"auto"`` is the local address of the interface that routes
    to the buffer (the one the other machines of the run reach us on); anything else as is."""
    if cfg.weights.host != "auto":
        return cfg.weights.host
    from urllib.parse import urlsplit

    target = urlsplit(address if address else cfg.buffer.redis.url).hostname or \
        cfg.buffer.zmq.host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # UDP: picks the route, sends nothing
        host = probe.getsockname()[0]
    logger.info("weights.host auto: %s (the route to the buffer at %s)", host, target)
    return host
