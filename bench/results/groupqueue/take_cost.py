"""The broker's take with a long queue: BrokerState.take of 8 groups from 4 producers' groups,
acked and refilled each round, no sockets.

    .venv/bin/python bench/results/groupqueue/take_cost.py CODE_ROOT

``CODE_ROOT``: a checkout (or a ``git archive`` copy of another commit) put first on
``sys.path``.
"""
import sys
import time
sys.path.insert(0, sys.argv[1])
from asyncrl.config.schema import BufferConfig
from buffers.zmq_state import BrokerState, QueuedGroup

for held in (64, 256, 1024, 4096):
    state = BrokerState(BufferConfig(max_groups=10**6, max_staleness=10**6), groups_per_step=8)
    seq = 0
    def put(n):
        global seq
        for _ in range(n):
            seq += 1
            g = QueuedGroup([b"x"], seq // 64, 1)
            state.in_flight[f"p{seq % 4}"] += 1
            state.accept(f"p{seq % 4}", g)
    put(held)
    rounds = 2000
    spent = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        groups = state.take("c", 8, 0)
        spent += time.perf_counter() - t
        state.ack("c", [state.receipt(g) for g in groups])
        put(8)
    print(f"queue {held:5d}: {spent / rounds * 1e6:8.1f} µs per take of 8")
