"""The broker's GroupQueue against the rule it implements, computed the slow way: a group's
key is the newest version among its producer's queued groups up to it, then its place."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from buffers.zmq_queue import GroupQueue


@dataclass(eq=False)
class G:
    producer: str
    min_version: int
    seq: int


def slow_pop(queue: list[G], count: int) -> list[G]:
    """What the broker did before GroupQueue: every key computed, the ``count`` smallest."""
    newest: dict[str, int] = {}
    keyed = []
    for place, g in enumerate(queue):
        newest[g.producer] = max(newest.get(g.producer, g.min_version), g.min_version)
        keyed.append(((newest[g.producer], place), g))
    chosen = [g for _, g in heapq.nsmallest(count, keyed, key=lambda item: item[0])]
    for g in chosen:
        queue.remove(g)
    return chosen


def test_random_operations_match_the_rule_and_keep_queue_order():
    rng = random.Random(7)
    for _ in range(40):
        fast: GroupQueue[G] = GroupQueue()
        slow: list[G] = []
        seq = 0
        for _ in range(300):
            op = rng.random()
            if op < 0.55:
                seq += 1
                g = G(rng.choice("abcd"), rng.choice([-1, 0, 1, 2, 3, 4]), seq)
                fast.append(g)
                slow.append(g)
            elif op < 0.75 and slow:
                count = rng.randint(1, 6)
                assert fast.pop_oldest(count) == slow_pop(slow, count)
            elif op < 0.85:
                back = [G(rng.choice("abcd"), rng.randint(0, 4), seq + i + 1) for i in range(3)]
                seq += 3
                fast.extend_front(back)
                slow[:0] = back
            elif op < 0.93:
                cutoff = rng.randint(0, 4)
                stale = [g for g in slow if 0 <= g.min_version < cutoff]
                assert fast.has_below(cutoff) == bool(stale)
                assert fast.drop_below(cutoff) == stale
                slow = [g for g in slow if g not in stale]
            elif slow:
                g = rng.choice(slow)
                assert fast.remove(g.seq) is g
                slow.remove(g)
                assert fast.remove(g.seq) is None
            assert list(fast) == slow and len(fast) == len(slow)


def test_a_long_queue_serves_its_oldest_groups_first():
    """10,000 queued groups of 4 producers, versions rising: the first 8 arrived leave."""
    queue: GroupQueue[G] = GroupQueue()
    for seq in range(10_000):
        queue.append(G("abcd"[seq % 4], seq // 100, seq))
    taken = queue.pop_oldest(8)
    assert [g.seq for g in taken] == list(range(8)) and len(queue) == 9_992
    assert not queue.has_below(0) and queue.has_below(1)
