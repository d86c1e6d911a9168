"""The ZMQ broker's queue of accepted groups not yet delivered, in the order it serves them.

A take serves the oldest versions first (earliest deadline first: see
:meth:`buffers.zmq_state.BrokerState.take`) and each producer's groups in their order: a
group's key is the newest version among its producer's queued groups up to it, then its place
in the queue. Keys grow along each producer's groups, so the ``count`` smallest are a merge of
the producers' heads: a take costs O(producers + count · log producers), whatever the queue
holds. Computing every key on each take, as the broker did first, cost O(queue): a take of 8
from 4,096 queued groups (``buffer.max_groups``' default) took 4.8 ms of the broker's only
thread, 21 µs now (bench/RESULTS.md).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from asyncrl.staleness import below_cutoff


class Queued(Protocol):
    producer: str
    min_version: int  # NO_VERSION (-1): no generated token (served first, never stale)
    seq: int


G = TypeVar("G", bound=Queued)


class GroupQueue(Generic[G]):
    """Queued groups, one deque per producer, each entry ``(place, group)`` in place order.

    Places are arrival order: appends count up from 0, groups put back at the front (a
    delivery reclaimed) count down below every place there is."""

    def __init__(self) -> None:
        self._by_producer: dict[str, deque[tuple[int, G]]] = {}
        self._producer_of: dict[int, str] = {}  # seq -> producer, to remove one by seq
        self._versions: Counter[int] = Counter()  # min_version of every queued group
        self._back = 0  # the next place at the back
        self._front = 0  # the lowest place given so far

    def __len__(self) -> int:
        return len(self._producer_of)

    def __iter__(self) -> Iterator[G]:
        """Every queued group in queue order (front first)."""
        for _, group in heapq.merge(*self._by_producer.values(), key=lambda item: item[0]):
            yield group

    def append(self, group: G) -> None:
        self._add(self._back, group, front=False)
        self._back += 1

    def extend_front(self, groups: Iterable[G]) -> None:
        """Put ``groups`` before every queued group, in the order given."""
        ordered = list(groups)
        self._front -= len(ordered)
        for i, group in reversed(list(enumerate(ordered))):
            self._add(self._front + i, group, front=True)

    def _add(self, place: int, group: G, front: bool) -> None:
        items = self._by_producer.setdefault(group.producer, deque())
        if front:
            items.appendleft((place, group))
        else:
            items.append((place, group))
        self._producer_of[group.seq] = group.producer
        self._versions[group.min_version] += 1

    def _forget(self, group: G) -> None:
        del self._producer_of[group.seq]
        self._versions[group.min_version] -= 1
        if not self._versions[group.min_version]:
            del self._versions[group.min_version]

    def pop_oldest(self, count: int) -> list[G]:
        """Remove and return up to ``count`` groups, smallest key first (module docstring)."""
        chosen = self.oldest(count)
        for group in chosen:  # each producer's chosen groups are the head of its deque
            items = self._by_producer[group.producer]
            items.popleft()
            if not items:
                del self._by_producer[group.producer]
            self._forget(group)
        return chosen

    def oldest(self, count: int) -> list[G]:
        """The groups :meth:`pop_oldest` would return, left in place (``pace`` looks first)."""
        heads = [(items[0][1].min_version, items[0][0], producer, 0)
                 for producer, items in self._by_producer.items()]
        heapq.heapify(heads)
        chosen: list[G] = []
        while heads and len(chosen) < count:
            key, _, producer, index = heapq.heappop(heads)
            items = self._by_producer[producer]
            chosen.append(items[index][1])
            if index + 1 < len(items):
                place, following = items[index + 1]
                heapq.heappush(heads, (max(key, following.min_version), place, producer,
                                       index + 1))
        return chosen

    def oldest_by_version(self, count: int) -> list[G]:
        """The ``count`` groups of smallest (oldest version, place), whoever put them: the
        order ``pace`` falls back to (:meth:`buffers.zmq_state.BrokerState.take`). O(queue)."""
        entries = (item for items in self._by_producer.values() for item in items)
        chosen = heapq.nsmallest(count, entries, key=lambda item: (item[1].min_version, item[0]))
        return [group for _, group in chosen]

    def version_counts(self) -> Counter[int]:
        """Queued groups by oldest version (a copy)."""
        return Counter(self._versions)

    def has_below(self, cutoff: int) -> bool:
        """Whether a queued group is stale at ``cutoff`` (:func:`asyncrl.staleness.stale_below`:
        its oldest version is in ``[0, cutoff)``). O(versions held)."""
        return any(below_cutoff(version, cutoff) for version in self._versions)

    def drop_below(self, cutoff: int) -> list[G]:
        """Remove and return, in queue order, every group stale at ``cutoff`` (see
        :meth:`has_below`). O(queue), but only when there is one."""
        if not self.has_below(cutoff):
            return []
        stale: list[tuple[int, G]] = []
        for producer, items in list(self._by_producer.items()):
            kept: deque[tuple[int, G]] = deque()
            for item in items:
                (stale if below_cutoff(item[1].min_version, cutoff) else kept).append(item)
            if kept:
                self._by_producer[producer] = kept
            else:
                del self._by_producer[producer]
        stale.sort(key=lambda item: item[0])  # queue order: places are arrival order
        for _, group in stale:
            self._forget(group)
        return [group for _, group in stale]

    def remove(self, seq: int) -> G | None:
        """Remove and return the group with sequence number ``seq``, if queued."""
        producer = self._producer_of.get(seq)
        if producer is None:
            return None
        items = self._by_producer[producer]
        entry = next(item for item in items if item[1].seq == seq)
        items.remove(entry)
        if not items:
            del self._by_producer[producer]
        self._forget(entry[1])
        return entry[1]
