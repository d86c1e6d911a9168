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

    Racy by nature: another process may take it before the group binds it. Good enough for
    tests and single-node runs where only we are picking ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
