"""Fan-out from every learner rank, over real gloo groups and a real broker: learner rank 0
(the broadcaster) and learner rank 1 (a :class:`SliceSender`) each serve half of four
engines; every engine ends with the same weights, and each rank sent about half.

The two learner ranks and the four engines run as threads of this process (each with its
own broker client, each group a real standalone gloo group): the protocol is what is under
test, and threads keep it to a few seconds on two cores.
"""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.fanout import SliceSender
from asyncrl.weights.receiver import WeightReceiver
from asyncrl.weights.slices import Seat, seat, slices
from buffers.zmq_broker import start_broker_thread
from tests.integration.conftest import wait_for
from buffers.zmq_client import ZmqBufferClient

ENGINES = ("engine-0", "engine-1", "engine-2", "engine-3")
TIMEOUT_S = 10.0


def test_each_learner_rank_serves_its_slice_of_the_engines() -> None:
    ann = {"members": list(ENGINES), "group": "g", "senders": 2, "epoch": 1}
    assert slices(ENGINES, 2) == [["engine-0", "engine-2"], ["engine-1", "engine-3"]]
    assert seat(ann, "engine-3") == Seat(1, "g-s1", 2, 3)
    assert seat({**ann, "senders": 1}, "engine-3") == Seat(0, "g", 4, 5), \
        "one sender: the epoch's own group, as before fan-out"
    assert [len(part) for part in slices([f"e{i}" for i in range(7)], 3)] == [3, 2, 2]


@pytest.mark.timeout(120)
def test_two_learner_ranks_deliver_to_four_engines_each_sending_half() -> None:
    torch.set_num_threads(1)
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    clients: list[ZmqBufferClient] = []

    def client() -> ZmqBufferClient:
        clients.append(ZmqBufferClient(address, 10.0))
        return clients[-1]

    control, beats = client(), client()
    got: dict[str, dict[int, dict[str, torch.Tensor]]] = {name: {} for name in ENGINES}

    def keeper(name: str):
        def apply(named: dict[str, torch.Tensor], version: int) -> None:
            got[name][version] = {k: v.clone() for k, v in named.items()}
        return apply

    receivers = [WeightReceiver(client(), name, keeper(name)) for name in ENGINES]
    sender = SliceSender(client(), rank=1)
    cfg = WeightsConfig(bucket_mb=0.001, alone_mb=0.0, timeout_s=TIMEOUT_S)
    broadcaster = WeightBroadcaster(control, cfg, senders=2)
    try:
        for name in ENGINES:
            beats.heartbeat(name, "rollout", {"engine_version": -1})
        for receiver in (*receivers, sender):
            receiver.start()
        def state_of(version: int) -> dict[str, torch.Tensor]:
            torch.manual_seed(version)
            return {"embed": torch.randn(64, 16), "norm": torch.randn(16).to(torch.bfloat16),
                    "head": torch.randn(16, 64), "step": torch.tensor([version])}

        for version in (1, 2):
            state = state_of(version)
            sender.offer(state_of(version), version)  # rank 1's own copy
            # With weights.overlap rank 1 gathers the next version while rank 0 still
            # delivers this one: offered before this one is announced, it must not hide it.
            sender.offer(state_of(version + 1), version + 1)
            for name in ENGINES:
                beats.heartbeat(name, "rollout", {"engine_version": version - 1})
            metrics = broadcaster.sync(state, version)
            assert metrics["weights/members"] == 4 and metrics["weights/evicted"] == 0
            for name in ENGINES:
                assert list(got[name][version]) == list(state)
                assert all(torch.equal(got[name][version][k], v) for k, v in state.items()), name
            total = metrics["weights/bytes"]
            assert metrics["weights/sent_engines"] == 2
            assert metrics["weights/sent_bytes"] == 2 * total
            # rank 1 counts a version once its own send returns, which may be after the
            # engines acked it to rank 0 (and sync returned): wait for the count, then check it
            wait_for(lambda: len(sender.sent_versions) >= version, 10.0, "rank 1's count")
            assert sender.sent_versions == list(range(1, version + 1))
            assert sender.sent_engines == 2 * version
            assert sender.sent_bytes == 2 * total * version
        assert metrics["weights/epoch"] == 1, "one epoch: both ranks' groups are reused"
        assert broadcaster.transport == "gloo", "auto, every end on the CPU"
    finally:
        broadcaster.close()
        for receiver in (*receivers, sender):
            receiver.stop()
        for each in clients:
            each.close()
        stop_broker()


@pytest.mark.timeout(120)
def test_an_engine_lost_in_another_ranks_slice_is_evicted_and_the_rest_served() -> None:
    """engine-3 (learner rank 1's slice) heartbeats once and never joins: it goes silent, is
    evicted, and the next epoch re-slices the three others over both ranks; rank 1 follows."""
    torch.set_num_threads(1)
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    clients: list[ZmqBufferClient] = []

    def client() -> ZmqBufferClient:
        clients.append(ZmqBufferClient(address, 10.0))
        return clients[-1]

    control, beats = client(), client()
    got: dict[str, int] = {}
    live = ENGINES[:3]
    receivers = [WeightReceiver(client(), name,
                                lambda named, version, name=name: got.__setitem__(name, version))
                 for name in live]
    sender = SliceSender(client(), rank=1)
    broadcaster = WeightBroadcaster(control, WeightsConfig(bucket_mb=0.001, timeout_s=4.0),
                                    senders=2)
    try:
        beats.heartbeat(ENGINES[3], "rollout", {"engine_version": -1})  # and never again
        for receiver in (*receivers, sender):
            receiver.start()
        state = {"w": torch.randn(256, 8)}
        sender.offer(state, 1)
        stop = threading.Event()

        def beat() -> None:  # the live engines' heartbeats, as their workers send them
            while not stop.wait(0.5):
                for name in live:
                    beats.heartbeat(name, "rollout", {"engine_version": got.get(name, -1)})

        beating = threading.Thread(target=beat)
        beating.start()
        try:
            metrics = broadcaster.sync(state, 1)
        finally:
            stop.set()
            beating.join()
        assert metrics["weights/members"] == 3 and metrics["weights/evicted"] == 1
        assert got == {name: 1 for name in live}
        assert set(broadcaster.evictions()) == {ENGINES[3]}
        wait_for(lambda: sender.sent_versions, 10.0, "rank 1's count")  # as above
        assert sender.sent_versions == [1] and sender.sent_engines == 1, \
            "rank 1 serves engine-1 alone once engine-3 is out"
    finally:
        broadcaster.close()
        for receiver in (*receivers, sender):
            receiver.stop()
        for each in clients:
            each.close()
        stop_broker()
