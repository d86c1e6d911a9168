"""The Redis take script against the rule it implements, over random operations.

The take keeps the unread entries in sorted sets and merges the producers' heads instead of
reading the whole index (``buffers.redis_data_scripts.TAKE``). :class:`Reference` is the rule
written out the direct way, as the script used to compute it: every candidate in arrival
order, stale ones dropped, each keyed by the newest version among its producer's candidates
up to it, the ``need`` smallest (key, arrival) taken only if that many are fresh. Random puts,
takes (some reclaiming everything any consumer holds, the caller too), acks, entries written
past the put script and entries acked or deleted behind the scripts' back run against a real
``redis-server`` and the reference; every take must choose the same entries in the same
order and drop as many.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import redis

from asyncrl.config.schema import BufferConfig, RedisBufferConfig
from buffers.redis_buffer import RedisBufferClient
from tests.buffers import make_group

pytestmark = pytest.mark.timeout(120)

NS = "asyncrl:order"
S = 2  # max_staleness
QUEUED = "~queued"  # owner of an entry no consumer has taken
GHOST = "~ghost"  # acked behind the scripts' back, never deleted: in no pending list


@dataclass
class Entry:
    id: str
    producer: str
    minv: int
    owner: str | None = None  # None: not read yet (XREADGROUP moves it to QUEUED)


def id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class Reference:
    """The buffer's entries and who holds them, and the take rule computed directly."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def ordered(self) -> list[Entry]:
        return sorted(self.entries.values(), key=lambda e: id_key(e.id))

    def take(self, consumer: str, need: int, learner_version: int,
             reclaim_all: bool) -> tuple[list[str], int]:
        for entry in self.entries.values():
            if entry.owner is None:
                entry.owner = QUEUED
        dropped, fresh, newest = 0, [], {}
        for entry in self.ordered():
            if not (entry.owner == QUEUED or (reclaim_all and entry.owner != GHOST)):
                continue
            if entry.minv >= 0 and learner_version - entry.minv > S:
                del self.entries[entry.id]
                dropped += 1
                continue
            key = max(newest.get(entry.producer, entry.minv), entry.minv)
            newest[entry.producer] = key
            fresh.append((key, len(fresh), entry))
        if need <= 0 or len(fresh) < need:
            return [], dropped
        chosen = [entry for _, _, entry in sorted(fresh, key=lambda c: c[:2])[:need]]
        for entry in chosen:
            entry.owner = consumer
        return [entry.id for entry in chosen], dropped

    def ack(self, ids: list[str]) -> int:
        acked = [i for i in ids if self.entries.get(i) and self.entries[i].owner not in
                 (None, GHOST)]
        for i in acked:
            del self.entries[i]
        return len(acked)

    def queued(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.owner == QUEUED]


@pytest.mark.parametrize("seed", range(12))
def test_takes_choose_what_the_direct_rule_chooses(redis_server, seed):
    rng = random.Random(seed)
    config = BufferConfig(type="redis", redis=RedisBufferConfig(url=redis_server.url, namespace=NS),
                          max_staleness=S, max_groups=10_000, request_timeout_s=5.0)
    client = RedisBufferClient(config, run_id="order", groups_per_step=10**6)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    index = f"{NS}:index"
    reference = Reference()
    producers = [f"w{i}" for i in range(4)] + ["a name with spaces:and colons"]
    consumers = ["c1", "c2", "c3"]
    learner_version, takes, served, drops = 0, 0, 0, 0

    def newest_id() -> str:
        return raw.xrevrange(index, count=1)[0][0]

    try:
        for step in range(400):
            op = rng.random()
            if op < 0.45:  # a put, its group a little older or newer than the learner
                producer = rng.choice(producers)
                minv = max(0, learner_version + rng.randint(-S - 2, 2))
                result = client.put(producer, make_group(f"g{step}", version=minv))
                assert result.accepted, result
                reference.entries[newest_id()] = Entry(newest_id(), producer, minv)
            elif op < 0.5:  # an entry written past the put script, maybe without a version
                fields = {"p": rng.choice(producers), "k": f"{NS}:g:absent{step}"}
                minv, kind = -1, rng.random()
                if kind < 0.6:
                    minv = max(0, learner_version + rng.randint(-S - 1, 1))
                    fields["minv"] = str(minv)
                elif kind < 0.8:  # no version the take can use: served first, never stale
                    fields["minv"] = rng.choice(["nan", "inf", "-inf", "x", "", "-3"])
                    minv = -3 if fields["minv"] == "-3" else -1
                entry_id = raw.xadd(index, fields)
                reference.entries[entry_id] = Entry(entry_id, fields["p"], minv)
            elif op < 0.53:  # a queued entry acked (and maybe deleted) behind their back
                queued = reference.queued()
                if queued:
                    ghost = rng.choice(queued)
                    assert raw.xack(index, "learners", ghost.id) == 1
                    ghost.owner = GHOST
                    if rng.random() < 0.5:
                        assert raw.xdel(index, ghost.id) == 1
                        del reference.entries[ghost.id]
            elif op < 0.68:  # a consumer acks some of what it holds
                consumer = rng.choice(consumers)
                held = [e.id for e in reference.entries.values() if e.owner == consumer]
                acks = rng.sample(held, rng.randint(0, len(held)))
                if rng.random() < 0.1 and reference.queued():  # an ack of a queued entry
                    acks.append(rng.choice(reference.queued()).id)
                args = [x for i in acks for x in (i, 0)]
                assert (client._run("ack", *args) if args else 0) == reference.ack(acks)
            else:  # a take, sometimes after the learner moved on
                if rng.random() < 0.3:
                    learner_version += 1
                consumer, need = rng.choice(consumers), rng.randint(0, 6)
                reclaim_all = rng.random() < 0.2
                lost, dropped, entries, *_ = client._run(
                    "take", consumer, need, learner_version, 0 if reclaim_all else 10**9, 0)
                want, want_dropped = reference.take(consumer, need, learner_version,
                                                    reclaim_all)
                got = [e[0].decode() for e in entries]
                assert (got, dropped) == (want, want_dropped), (
                    f"step {step}: take({consumer}, need={need}, v={learner_version}, "
                    f"reclaim_all={reclaim_all})")
                assert raw.zcard(f"{NS}:queue") == len(reference.queued())
                assert lost == []
                takes, served, drops = takes + 1, served + len(want), drops + want_dropped
        assert raw.xlen(index) == len(reference.entries)
    finally:
        client.close()
    assert takes > 50 and served > 40 and drops > 5  # the walk exercised every branch
