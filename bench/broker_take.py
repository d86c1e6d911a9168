"""What one take costs the ZMQ broker with many groups queued, without sockets.

The broker's only thread serves every put and take, so a take that grows with the queue
stalls every producer meanwhile. :class:`buffers.zmq_state.BrokerState` keeps one queue per
producer and merges their heads (``buffers/zmq_queue.py``), so a take should cost about the
same at 64 queued groups as at 4,096 (``buffer.max_groups``' default). For each ``--queued``
size this fills a broker state with that many one-frame groups from four producers (granted
through ``acquire``, as a worker's are), then times ``take`` of 8 groups over ``--rounds``,
acking the batch and putting 8 more after each (outside the clock), and prints µs per take.

    python bench/broker_take.py [--queued 64 256 1024 4096] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.schema import BufferConfig  # noqa: E402
from buffers.zmq_state import BrokerState, QueuedGroup  # noqa: E402

BATCH = 8
PRODUCERS = 4
VERSIONS_EVERY = 64  # groups per version: the queue spans queued / 64 versions


class Filler:
    """Puts one-frame groups into ``state``, round robin over the producers, each granted
    first; versions grow every :data:`VERSIONS_EVERY` groups."""

    def __init__(self, state: BrokerState) -> None:
        self.state, self.seq = state, 0

    def put(self, count: int) -> None:
        for _ in range(count):
            self.seq += 1
            producer = f"p{self.seq % PRODUCERS}"
            if self.state.acquire(producer, 1, 0) != 1:
                raise RuntimeError("no grant: the bound is too low")
            group = QueuedGroup([b"x"], self.seq // VERSIONS_EVERY, 1)
            reason = self.state.accept(producer, group)
            if reason:
                raise RuntimeError(f"group refused: {reason}")


def take_us(queued: int, rounds: int) -> float:
    """Mean µs of one ``take`` of :data:`BATCH` with ``queued`` groups held."""
    state = BrokerState(BufferConfig(max_groups=10**6, max_staleness=1000), groups_per_step=8)
    filler = Filler(state)
    filler.put(queued)
    spent = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        groups = state.take("learner", BATCH, 0)
        spent += time.perf_counter() - start
        if groups is None:
            raise RuntimeError(f"fewer than {BATCH} groups queued")
        state.ack("learner", [state.receipt(g) for g in groups])
        filler.put(BATCH)
    return spent / rounds * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    print(f"| groups queued | µs per take of {BATCH} |")
    print("|---:|---:|")
    for queued in args.queued:
        print(f"| {queued:,} | {take_us(queued, args.rounds):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
