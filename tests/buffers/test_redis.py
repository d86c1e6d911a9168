"""Redis-only behaviour: AOF durability, reclaim, validation by consumers, auth, ACL, TLS.

Every test runs a private ``redis-server`` on a free loopback port (``redis_server`` fixture,
AOF on). The TLS test is real: this ``redis-server`` is built with TLS (it accepts
``--tls-port``), and certificates are made with the ``openssl`` command line.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from asyncrl.config.schema import BufferConfig, RedisBufferConfig
from asyncrl.wire import Rejections, encode_group, encode_group_views
from buffers import make_buffer_client
from buffers.protocol import PutResult
from buffers.lease import keep_leased
from buffers.redis_buffer import RedisBufferClient, reset_run, start_run
from buffers.redis_entries import put_results, stage_put
from buffers.redis_connect import connect, connection_kwargs, run_namespace
from buffers.packing import pack_group
from buffers.redis_scripts import GROUP, QUEUE
from tests.buffers import eventually, make_group
from tests.buffers.conftest import RedisServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def open_client(redis_server: RedisServer) -> Iterator[Any]:
    """``open_client(**BufferConfig fields)``: clients on the private server, closed after."""
    clients: list[RedisBufferClient] = []

    def open_(groups_per_step: int = 2, **fields: Any) -> RedisBufferClient:
        config = BufferConfig(type="redis",
                              redis=RedisBufferConfig(url=redis_server.url, namespace="asyncrl:t"),
                              **{"max_staleness": 1, "request_timeout_s": 5.0, **fields})
        clients.append(RedisBufferClient(config, run_id="t", groups_per_step=groups_per_step))
        return clients[-1]

    yield open_
    for client in clients:
        client.close()


def admin(server: RedisServer, **kwargs: Any) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, **kwargs)


def test_sigkill_of_redis_with_aof_loses_nothing_and_clients_reconnect(redis_server,
                                                                        open_client):
    c = open_client(reclaim_idle_s=0.5)
    for version in (1, 2):  # one by one: version 2 alone, nothing consumed, means a lost state
        c.publish_version(version)
    seq = c.set_key("rdzv", {"epoch": 7})
    c.heartbeat("worker-0", "rollout", {"engine_version": 2})
    for i in range(4):
        assert c.put("w", make_group(f"g{i}", version=2)).accepted
    c.ack("learner", c.get_batch("learner", 1, 2, timeout_s=5.0))
    assert [g.group_id for g in c.get_batch("learner", 1, 2, 5.0).groups] == ["g1"]  # no ack
    c.put_frames("w", encode_group(make_group("bad"))[:3])
    before = c.status()
    redis_server.restart(kill=True)
    after = c.status()  # the same client: it reconnects, the scripts are loaded again
    for key in ("version", "accepted", "consumed", "rejected", "depth", "staleness_hist",
                "keys", "run_id", "pending"):
        assert after[key] == before[key], key
    assert after["members"]["worker-0"]["info"] == {"engine_version": 2}
    assert c.get_key("rdzv") == (seq, {"epoch": 7})
    assert c.set_key("rdzv", {"epoch": 8}) == seq + 1
    batch = c.get_batch("other-learner", 3, 2, timeout_s=10.0)  # g1 once reclaimable
    assert sorted(g.group_id for g in batch.groups) == ["g1", "g2", "g3"]
    c.ack("other-learner", batch)
    assert c.status()["consumed"] == 4


def test_key_numbers_go_up_even_after_redis_lost_its_data(redis_server, open_client):
    """A Redis without persistence that restarted has lost the keys; a waiter still holds a
    number from before, and what is set next must be newer than it (see the ZMQ twin in
    tests/unit/test_zmq_buffer.py)."""
    c = open_client()
    seen = max(c.set_key("weights/announce", {"epoch": e}) for e in range(3))
    admin(redis_server).flushall()  # what a restart without persistence leaves
    new = c.set_key("weights/announce", {"epoch": 0})
    assert new > seen and c.get_key("weights/announce", newer_than=seen) == (new, {"epoch": 0})


def test_reclaim_moves_a_dead_consumers_entries_and_counts_the_redelivery(redis_server,
                                                                         open_client):
    dead, alive = open_client(reclaim_idle_s=0.3), open_client(reclaim_idle_s=0.3)
    for i in range(2):
        dead.put("w", make_group(f"g{i}"))
    taken = dead.get_batch("learner", 2, 0, timeout_s=5.0)
    owner = admin(redis_server).xpending_range("asyncrl:t:index", GROUP, "-", "+", 10)
    assert {e["consumer"].decode() for e in owner} == {dead._consumer.name("learner")}
    again = alive.get_batch("learner", 2, 0, timeout_s=10.0)  # same name, other process role
    assert again.receipts == taken.receipts
    pending = admin(redis_server).xpending_range("asyncrl:t:index", GROUP, "-", "+", 10)
    assert {e["consumer"].decode() for e in pending} == {alive._consumer.name("learner")}
    assert all(e["times_delivered"] == 2 for e in pending)
    assert alive._consumer.name("learner") != dead._consumer.name("learner")
    alive.ack("learner", again)
    status = alive.status()
    assert (status["redelivered"], status["consumed"], status["pending"]) == (2, 2, 0)


def test_reclaimed_groups_compete_by_deadline_with_the_queued_ones(redis_server, open_client):
    """A dead learner's batch of version 0 comes back ahead of version-1 groups that arrived
    after it, and groups still queued wait in the pending list of the reserved consumer.

    The time that makes "old" reclaimable passes in Redis, not on the clock: every delivered
    entry is aged past ``reclaim_idle_s`` at once (:func:`_age`). With a 0.3 s
    ``reclaim_idle_s`` and a real wait, "old" had to stay unreclaimed until alive's first
    take, a race a loaded machine could lose (alive then got "old" first)."""
    dead, alive = open_client(reclaim_idle_s=60.0), open_client(reclaim_idle_s=60.0)
    dead.put("w", make_group("old", version=0))
    assert dead.get_batch("learner", 1, 0, timeout_s=5.0) is not None  # then it dies
    for name in ("new1", "new2"):
        alive.put("w", make_group(name, version=1))
    held = alive.get_batch("learner", 1, 1, timeout_s=0.1)  # new1: "old" is not idle yet
    assert [g.group_id for g in held.groups] == ["new1"]
    for client in (dead, alive):   # 61 s pass for what each holds, renewed by nobody
        _age(redis_server, client._consumer.name("learner"), 61.0)
    assert alive.renew("learner", held) == 1  # alive renews what it holds: not reclaimed
    queued = admin(redis_server).xpending_range("asyncrl:t:index", GROUP, "-", "+", 10, QUEUE)
    assert len(queued) == 1  # new2 waits there
    assert alive.status()["pending"] == 2  # delivered: old and new1, not the queued new2
    batch = alive.get_batch("learner", 2, 1, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["old", "new2"]
    assert alive.status()["redelivered"] == 1


def _age(server: RedisServer, consumer: str, seconds: float) -> None:
    """Make the entries ``consumer`` holds look unrenewed for ``seconds``, as if that time had
    passed: XCLAIM to the same owner with IDLE (JUSTID: no delivery is counted)."""
    with admin(server) as redis_admin:
        held = [e["message_id"] for e in redis_admin.xpending_range(
            "asyncrl:t:index", GROUP, "-", "+", 100, consumer)]
        assert held, consumer
        redis_admin.xclaim("asyncrl:t:index", GROUP, consumer, 0, held,
                           idle=int(seconds * 1000), justid=True)


def test_an_entry_acked_behind_the_clients_back_is_never_served(redis_server, open_client):
    """An entry in no pending list (acked by someone else, not deleted) breaks the take's
    count of where entries wait: it then asks the queue's list, and serves the rest."""
    c = open_client(groups_per_step=4)
    for name in ("a", "b", "c"):
        c.put("w", make_group(name))
    assert c.get_batch("learner", 4, 0, timeout_s=0.1) is None  # moves all three to the queue
    raw = admin(redis_server)
    first = raw.xrange("asyncrl:t:index", count=1)[0][0]
    raw.xack("asyncrl:t:index", GROUP, first)
    batch = c.get_batch("learner", 2, 0, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["b", "c"]
    c.ack("learner", batch)
    assert c.status()["pending"] == 0


def test_queued_entries_without_the_queue_sets_are_served_in_order(redis_server, open_client):
    """A namespace whose queued entries are not in the take's sorted sets (written by a
    version that had none, or the sets deleted) is rebuilt from the queue's pending list."""
    c = open_client(groups_per_step=8, max_staleness=2)
    for name, version in (("a", 1), ("b", 0), ("c", 0)):
        c.put("w" if name != "c" else "v", make_group(name, version=version))
    assert c.get_batch("learner", 8, 0, timeout_s=0.1) is None  # read into the queue
    assert admin(redis_server).delete("asyncrl:t:queue", "asyncrl:t:queuev") == 2
    batch = c.get_batch("learner", 3, 0, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["c", "a", "b"]  # b waits behind w's a
    c.ack("learner", batch)
    assert c.status()["consumed"] == 3


def test_a_take_run_again_after_a_lost_reply_strands_nothing(open_client):
    """redis-py sends a command again when its connection breaks before the reply: the first
    run's batch, held under the caller's own name and unknown to the client, is never renewed
    and comes back after reclaim_idle_s, to that same (single) learner."""
    c = open_client(max_groups=4, reclaim_idle_s=0.3)
    for i in range(4):
        assert c.put("w", make_group(f"g{i}")).accepted
    lost = c._run("take", c._consumer.name("learner"), 2, 0, 300, 0)  # ran; reply lost
    assert len(lost[2]) == 2
    batch = c.get_batch("learner", 2, 0, timeout_s=5.0)  # the run redis-py sent again
    assert [g.group_id for g in batch.groups] == ["g2", "g3"]
    c.ack("learner", batch)
    again = c.get_batch("learner", 2, 0, timeout_s=5.0)
    assert [g.group_id for g in again.groups] == ["g0", "g1"]
    c.ack("learner", again)
    status = c.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (4, 0, 2)


def test_a_batch_one_client_took_is_renewed_by_another_client_of_the_learner(open_client):
    """The learner's prefetcher takes on a client of its own while the training loop renews
    the batch in training on another: a take reclaims idle entries whoever holds them, so
    without that renewal the prefetcher would serve the batch again during a long step."""
    taker, trainer = open_client(reclaim_idle_s=0.3), open_client(reclaim_idle_s=0.3)
    taker.put("w", make_group("a"))
    batch = taker.get_batch("learner", 1, 0, timeout_s=5.0)
    assert trainer.renew("learner", batch) == 1
    assert trainer.renew("other", batch) == 0
    with keep_leased(trainer, "learner", batch, reclaim_idle_s=0.3):  # a 1 s step
        assert taker.get_batch("learner", 1, 0, timeout_s=1.0) is None
    trainer.ack("learner", batch)
    status = taker.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (1, 0, 0)


def _raw_entry(raw: redis.Redis, name: str, **replace: bytes) -> None:
    """Write a group as a rogue producer would: payload and index entry, no counters, and
    ``replace`` fields of the frames (h t l m v) or of the entry (minv, k)."""
    group = make_group(name)
    frames = dict(zip(("h", "t", "l", "m", "v"), encode_group(group)))
    frames.update({k: v for k, v in replace.items() if k in frames})
    key = f"asyncrl:t:g:rogue-{name}"
    raw.set(key, pack_group([v for v in frames.values() if v != b"<drop>"]))
    fields = {"minv": str(group.min_version()).encode(), "p": b"rogue", "k": key.encode()}
    fields.update({k: v for k, v in replace.items() if k in fields})
    raw.xadd("asyncrl:t:index", fields)


def test_consumers_reject_entries_that_bypassed_the_client(redis_server, open_client):
    """A producer writing the streams directly cannot crash or poison learners: each bad entry
    is rejected with a counted reason, acked and deleted (its payload too), and batches stay
    exactly full. An entry naming a key outside the run's payloads never has it read or
    deleted."""
    c = open_client(groups_per_step=8, max_message_bytes=2048)
    raw = admin(redis_server)
    header = orjson.loads(encode_group(make_group("x"))[0])
    raw.set("asyncrl:t:precious", b"keep me")
    bad = {"frames": dict(t=b"<drop>"),
           "schema": dict(h=orjson.dumps({**header, "schema": 9})),
           "oversized": dict(t=b"\0" * 4096),
           "version": dict(minv=b"5")}
    c.put("w", make_group("g0"))
    for i, fields in enumerate(bad.values()):
        _raw_entry(raw, f"r{i}", **fields)  # no counters: a rogue writer
    raw.xadd("asyncrl:t:index", {"minv": b"0", "p": b"rogue", "k": b"asyncrl:t:precious"})
    c.put("w", make_group("g1"))
    c.put("w", make_group("g2"))
    batch = c.get_batch("learner", 3, 0, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    c.ack("learner", batch)
    # The "version" entry claims minv 5, and so the precious one after it from the same
    # producer is keyed 5 too: both are due after every group of version 0 (earliest
    # deadline first), so the next take meets them.
    assert c.get_batch("learner", 1, 0, timeout_s=0.5) is None  # nothing valid was left
    status = c.status()
    assert status["rejected"] == {**{reason: 1 for reason in bad}, "frames": 2}
    assert (status["depth"], status["pending"], status["consumed"]) == (0, 0, 3)
    assert raw.get("asyncrl:t:precious") == b"keep me"
    assert list(raw.scan_iter(match="asyncrl:t:g:*")) == []  # no payload outlives its entry


def test_a_partial_batch_left_from_a_larger_request_serves_a_smaller_one(redis_server,
                                                                          open_client):
    """A bad entry leaves a partial batch held by the client; when the next request wants no
    more than it holds, the take has nothing to claim (need 0) and the held groups serve."""
    c = open_client(groups_per_step=4)
    c.put("w", make_group("g0"))
    _raw_entry(admin(redis_server), "bad", minv=b"5")
    c.put("w", make_group("g1"))
    assert c.get_batch("learner", 3, 0, timeout_s=0.3) is None  # g0, g1 held; bad rejected
    c.put("w", make_group("g2"))  # queued while the client holds more than it will ask for
    batches = [c.get_batch("learner", 1, 0, timeout_s=1.0) for _ in range(3)]
    assert [g.group_id for b in batches for g in b.groups] == ["g0", "g1", "g2"]
    for batch in batches:
        c.ack("learner", batch)
    status = c.status()
    assert (status["consumed"], status["rejected"], status["depth"]) == (3, {"version": 1}, 0)


def _payload_ttls(server: RedisServer) -> list[int]:
    raw = admin(server)
    return sorted(raw.pttl(key) for key in raw.scan_iter(match="asyncrl:t:g:*"))


def test_payloads_are_kept_once_accepted_and_expire_if_never_filed(redis_server, open_client):
    """A payload staged for a put that never got in (full, then the producer gave up) expires
    by itself; an accepted one is kept until its group is acked or dropped, then deleted."""
    c = open_client(groups_per_step=8, max_groups=1, request_timeout_s=0.5, max_staleness=0)
    assert c.put("w", make_group("kept")).accepted
    with pytest.raises(TimeoutError):
        c.put("w", make_group("never-filed"))
    kept, staged = _payload_ttls(redis_server)
    assert kept == -1 and 0 < staged <= (2 * 0.5 + 30) * 1000
    assert c.get_batch("learner", 1, learner_version=1, timeout_s=0.2) is None  # stale: dropped
    (left,) = _payload_ttls(redis_server)  # the dropped group's payload went with it
    assert 0 < left <= staged
    assert c.status()["dropped_stale"] == 1


def test_a_staged_payload_that_expired_while_waiting_is_rejected_and_counted(redis_server,
                                                                           open_client):
    c = open_client(groups_per_step=8, max_groups=1, request_timeout_s=10.0)
    learner = open_client(groups_per_step=8, max_groups=1)
    raw = admin(redis_server)
    c.put("w", make_group("g0"))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(c.put, "w", make_group("g1"))
        eventually(lambda: len(_payload_ttls(redis_server)) == 2, what="g1 staged")
        (staged,) = [k for k in raw.scan_iter(match="asyncrl:t:g:*") if raw.pttl(k) > 0]
        raw.delete(staged)  # as if it expired while the producer waited for room
        learner.ack("learner", learner.get_batch("learner", 1, 0, timeout_s=5.0))
        assert future.result(timeout=10) == PutResult(accepted=False, reason="expired")
    status = learner.status()
    assert (status["accepted"], status["rejected"], status["depth"]) == (1, {"expired": 1}, 0)
    assert status["in_flight"] == 0 and _payload_ttls(redis_server) == []


def test_a_put_sent_again_after_a_lost_reply_files_its_group_once(redis_server, open_client):
    """redis-py re-sends a pipeline whose connection broke: the payload SET and the put script
    run twice. The second run finds the payload kept (filed by the first) and answers it
    accepted without a second entry, even with the buffer now full, and leaves it kept."""
    c = open_client(groups_per_step=8, max_groups=1)
    items = [stage_put(encode_group_views(make_group("once")), c.config.max_message_bytes,
                       Rejections(), "w")]
    c.acquire("w", 1, 0)
    assert put_results(c._put_window("w", items)) == ([PutResult(accepted=True)], False)
    items[0].staged = False  # the same pipeline, sent again
    assert put_results(c._put_window("w", items)) == ([PutResult(accepted=True)], False)
    status = c.status()
    assert (status["accepted"], status["depth"], status["in_flight"]) == (1, 1, 0)
    assert _payload_ttls(redis_server) == [-1]
    assert [g.group_id for g in c.get_batch("learner", 1, 0, timeout_s=5.0).groups] == ["once"]


def test_a_put_after_redis_forgot_the_scripts_loads_them_and_goes_through(redis_server,
                                                                          open_client):
    c = open_client(groups_per_step=8)
    assert c.put("w", make_group("before")).accepted
    admin(redis_server).script_flush()  # as a restart without persistence of scripts does
    assert c.put_many("w", [make_group("after")]) == [PutResult(accepted=True)]
    assert c.status()["accepted"] == 2 and _payload_ttls(redis_server) == [-1, -1]


def test_reset_run_deletes_every_key_of_the_run_and_no_other(redis_server, open_client):
    c = open_client(groups_per_step=8)
    c.put("w", make_group("g0"))
    c.put("w", make_group("g1"))
    c.get_batch("learner", 1, 0, timeout_s=5.0)  # one pending, one unread
    raw = admin(redis_server)
    raw.set("asyncrl:tother", b"not this run's")
    assert reset_run(c.config, "t") >= 4
    assert sorted(raw.scan_iter(match="asyncrl:t*")) == [b"asyncrl:tother"]


def test_up_keeps_a_resumed_runs_state_and_clears_a_new_runs(redis_server, open_client):
    """What both launchers do with Redis at the start of a run (:func:`start_run`)."""
    c = open_client(groups_per_step=8)
    c.put("w", make_group("g0"))
    start_run(c.config, "t", resuming=True)
    assert c.status()["accepted"] == 1
    start_run(c.config, "t", resuming=False)
    assert not list(admin(redis_server).scan_iter(match="asyncrl:t*"))


def test_waiting_blocks_in_redis_instead_of_spinning(redis_server, open_client):
    c = open_client(reclaim_idle_s=60.0)
    stats = admin(redis_server)

    def commands() -> int:  # what the client sent: commands inside scripts are not counted
        info = stats.info("commandstats")
        return sum(info.get(f"cmdstat_{name}", {}).get("calls", 0)
                   for name in ("evalsha", "eval", "xread", "exec"))

    before = commands()
    assert c.get_batch("learner", 1, 0, timeout_s=1.5) is None
    assert c.get_key("nothing", timeout_s=1.5) is None
    assert commands() - before < 20  # a spinning loop would issue thousands


def test_password_is_passed_through(tmp_path):
    server = RedisServer(tmp_path / "auth", extra=["--requirepass", "s3cret"])
    server.start()
    try:
        config = BufferConfig(type="redis", redis=RedisBufferConfig(url=server.url,
                                                                    password="s3cret"))
        with RedisBufferClient(config, run_id="auth", groups_per_step=1) as c:
            assert c.put("w", make_group("a")).accepted
        for password in ("", "wrong"):
            start = time.monotonic()
            with pytest.raises(redis.AuthenticationError):
                RedisBufferClient(config.with_fields("redis", password=password), "auth", 1)
            assert time.monotonic() - start < 2.0  # a refused login is not retried
    finally:
        server.stop()


def test_acl_user_is_passed_through_and_confined_to_its_namespace(redis_server):
    admin(redis_server).acl_setuser("learner", enabled=True, passwords=["+pw"],
                                    keys=["asyncrl:acl:*"], commands=["+@all", "-@dangerous"])
    config = BufferConfig(type="redis", redis=RedisBufferConfig(
        url=redis_server.url, username="learner", password="pw", namespace="asyncrl:acl"))
    with RedisBufferClient(config, groups_per_step=1) as c:
        assert c.put("w", make_group("a")).accepted
        assert c.status()["accepted"] == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        RedisBufferClient(config.with_fields("redis", namespace="asyncrl:other"),
                          groups_per_step=1)


def test_tls_options_reach_redis_py():
    config = BufferConfig(type="redis", redis=RedisBufferConfig(
        url="rediss://127.0.0.1:6390/0", username="u", password="p", tls_ca_file="ca.crt",
        tls_cert_file="c.crt", tls_key_file="c.key", cluster="no"))  # "auto" would ask it
    kwargs = connection_kwargs(config)
    assert {k: kwargs[k] for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "username",
                                   "password")} == \
        {"ssl_ca_certs": "ca.crt", "ssl_certfile": "c.crt", "ssl_keyfile": "c.key",
         "username": "u", "password": "p"}
    pool_kwargs = connect(config).connection_pool.connection_kwargs
    assert pool_kwargs["ssl_ca_certs"] == "ca.crt" and pool_kwargs["ssl_keyfile"] == "c.key"
    with pytest.raises(ValueError, match="rediss"):
        connection_kwargs(config.with_fields("redis", url="redis://127.0.0.1:6390/0"))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A CA, a server certificate for IP 127.0.0.1 and a client certificate, all EC."""
    directory.mkdir(parents=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=asyncrl-test-ca", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
                 "-extfile", "san.ext", cwd=directory)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_against_a_real_tls_server(tmp_path):
    certs = tmp_path / "certs"
    make_certificates(certs)
    server = RedisServer(tmp_path / "tls", tls=True, extra=[
        "--tls-cert-file", str(certs / "server.crt"), "--tls-key-file", str(certs / "server.key"),
        "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "yes"])
    server.start()
    try:
        config = BufferConfig(type="redis", request_timeout_s=1.0, redis=RedisBufferConfig(
            url=server.url, tls_ca_file=str(certs / "ca.crt"),
            tls_cert_file=str(certs / "client.crt"), tls_key_file=str(certs / "client.key")))
        with make_buffer_client(config, run_id="tls", groups_per_step=1) as c:
            assert c.put("w", make_group("a")).accepted
            batch = c.get_batch("learner", 1, 0, timeout_s=5.0)
            c.ack("learner", batch)
            assert c.status()["consumed"] == 1
        no_client_cert = config.with_fields("redis", tls_cert_file="", tls_key_file="") \
            .with_fields(request_timeout_s=0.2)
        with pytest.raises(redis.ConnectionError):
            RedisBufferClient(no_client_cert, "tls", 1)
    finally:
        server.stop()


def test_factory_needs_groups_per_step_for_redis():
    with pytest.raises(ValueError, match="groups_per_step"):
        make_buffer_client(BufferConfig(type="redis"))


def test_a_run_namespace_is_wrapped_in_a_hash_tag_on_a_cluster_only() -> None:
    """Every key of a run must hash to one slot of a cluster (the scripts touch them together):
    a namespace without a hash tag is wrapped in one there, and left as it is elsewhere."""
    default = BufferConfig(type="redis")
    named = default.with_fields("redis", namespace="team:x")
    assert run_namespace(default, "r1", cluster=False) == "asyncrl:r1"
    assert run_namespace(default, "r1", cluster=True) == "{asyncrl:r1}"
    assert run_namespace(named, "r1", cluster=True) == "{team:x}"
    for tagged in ("{team}:x", "a{b}c", "x{y}{z}"):  # Redis hashes the first {...} only
        assert run_namespace(default.with_fields("redis", namespace=tagged), "r1",
                             cluster=True) == tagged
    for untagged in ("a{}b", "a}b{c", "a{b"):  # an empty or unclosed tag hashes the whole key
        assert run_namespace(default.with_fields("redis", namespace=untagged), "r1",
                             cluster=True) == f"{{{untagged}}}"
