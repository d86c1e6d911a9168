"""The colocated phases (``asyncrl.colocate``) over a real ZMQ broker with real torch engines:
while the learner would step, every engine has released its weights and KV cache, and
generation waits; once the learner lets go, the engines have them back and generate.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from asyncrl.colocate import PhaseConductor, PhaseFollower, ack_key  # noqa: E402
from asyncrl.config.schema import BufferConfig, TinyModelConfig, ZmqBufferConfig  # noqa: E402
from asyncrl.control_plane import STOPPED  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model  # noqa: E402
from buffers.zmq_broker import start_broker_thread  # noqa: E402
from buffers.zmq_client import ZmqBufferClient  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402

torch.set_num_threads(1)
PROMPTS = [[1, 5, 6, 7, 2], [1, 9, 2]]
MEMBERS = ["rollout-0-1", "rollout-1-1"]


@pytest.fixture
def address() -> Iterator[str]:
    addr, stop = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)), 2)
    yield addr
    stop()


class Fleet:
    """Two engines, each with its follower on a client of its own, and their phase reports."""

    def __init__(self, address: str) -> None:
        self.clients: list[ZmqBufferClient] = []
        self.engines = [TorchEngine(build_tiny_model(TinyModelConfig(), len(VOCAB), i),
                                    eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=i) for i in range(2)]
        self.phases: dict[str, list[str]] = {m: [] for m in MEMBERS}
        self.moved = threading.Condition()
        self.followers = [PhaseFollower(self._client(address), member, engine,
                                        on_phase=self._reporter(member))
                          for member, engine in zip(MEMBERS, self.engines)]
        beat = self._client(address)
        for member in MEMBERS:
            beat.heartbeat(member, "rollout", {})   # present: the conductor waits for them

    def _client(self, address: str) -> ZmqBufferClient:
        self.clients.append(ZmqBufferClient(address, timeout_s=5.0))
        return self.clients[-1]

    def _reporter(self, member: str):
        def report(phase: str) -> None:
            with self.moved:
                self.phases[member].append(phase)
                self.moved.notify_all()
        return report

    def wait_all(self, phase: str, count: int) -> None:
        with self.moved:
            assert self.moved.wait_for(lambda: all(
                p.count(phase) >= count for p in self.phases.values()), 30)

    def close(self) -> None:
        for follower in self.followers:
            follower.close()
        for client in self.clients:
            client.close()


@pytest.fixture
def fleet(address: str) -> Iterator[Fleet]:
    fleet = Fleet(address)
    for follower in fleet.followers:
        follower.start()
    yield fleet
    fleet.close()


def test_engines_hold_nothing_while_the_learner_steps(address: str, fleet: Fleet) -> None:
    control = ZmqBufferClient(address, timeout_s=5.0)
    conductor = PhaseConductor(control, timeout_s=30.0)
    awake = [engine.memory() for engine in fleet.engines]
    for step in range(1, 3):
        metrics = conductor.to_train()
        assert metrics["colocate/engines"] == 2 and metrics["colocate/not_asleep"] == 0
        assert metrics["colocate/asleep_held_bytes"] == 0   # as the engines reported it
        for engine in fleet.engines:   # what the learner's step may use is free
            held = engine.memory()
            assert engine.asleep and held["weights_bytes"] == 0 and held["kv_bytes"] == 0
            assert held["host_bytes"] == awake[0]["weights_bytes"]
        done = threading.Event()
        blocked = threading.Thread(target=lambda: (fleet.engines[0].generate(
            PROMPTS, n=2, temperature=1.0, max_new_tokens=3), done.set()))
        blocked.start()
        assert not done.wait(0.2)      # no generation on the learner's time
        conductor.to_rollout()
        fleet.wait_all("awake", step)
        assert done.wait(30)           # ... and it goes on once the engines are back
        blocked.join(30)
        assert [engine.memory() for engine in fleet.engines] == awake
    # the next train phase reads the engines' own wake times
    assert conductor.to_train()["colocate/wake_s"] > 0
    control.close()


def test_a_sleep_request_waits_for_the_call_in_flight(address: str, fleet: Fleet) -> None:
    engine = fleet.engines[0]
    mid_call, may_go = threading.Event(), threading.Event()

    def hold(step: int) -> None:
        if step == 1:
            mid_call.set()
            may_go.wait(30)

    engine.on_step = hold
    call = threading.Thread(target=engine.generate, args=(PROMPTS, 2, 1.0, 4))
    call.start()
    assert mid_call.wait(30)
    control = ZmqBufferClient(address, timeout_s=5.0)
    result: dict = {}
    conductor = PhaseConductor(control, timeout_s=30.0)
    train = threading.Thread(target=lambda: result.update(conductor.to_train()))
    train.start()
    with fleet.moved:   # the other engine sleeps; this one is still generating
        assert fleet.moved.wait_for(lambda: fleet.phases[MEMBERS[1]] == ["asleep"], 30)
    assert engine.memory()["weights_bytes"] > 0   # its call in flight still has them
    assert train.is_alive()
    engine.on_step = None
    may_go.set()
    train.join(30)
    call.join(30)
    assert result["colocate/not_asleep"] == 0 and engine.memory()["weights_bytes"] == 0
    conductor.to_rollout()
    fleet.wait_all("awake", 1)
    control.close()


def test_an_engine_that_stops_is_not_waited_for(address: str, fleet: Fleet) -> None:
    control = ZmqBufferClient(address, timeout_s=5.0)
    control.heartbeat("rollout-9-1", "rollout", {})   # present, but nobody follows for it
    conductor = PhaseConductor(control, timeout_s=60.0)
    result: dict = {}
    start = time.monotonic()
    train = threading.Thread(target=lambda: result.update(conductor.to_train()))
    train.start()
    fleet.wait_all("asleep", 1)
    control_2 = ZmqBufferClient(address, timeout_s=5.0)
    control_2.heartbeat("rollout-9-1", "rollout", {"state": STOPPED})
    train.join(30)
    assert not train.is_alive() and time.monotonic() - start < 30
    assert result["colocate/engines"] == 3 and result["colocate/not_asleep"] == 1
    conductor.to_rollout()
    fleet.wait_all("awake", 1)
    control.close()
    control_2.close()


def test_a_frozen_engine_is_waited_for_half_the_timeout(address: str, fleet: Fleet) -> None:
    """Listed alive but silent (SIGSTOPped): given up on as the weight sync gives up on it,
    after half of ``weights.timeout_s``, not the whole of it."""
    control = ZmqBufferClient(address, timeout_s=5.0)
    control.heartbeat("rollout-9-1", "rollout", {})   # and then never again
    conductor = PhaseConductor(control, timeout_s=8.0)
    start = time.monotonic()
    result = conductor.to_train()
    assert 3.5 < time.monotonic() - start < 7.5
    assert result["colocate/not_asleep"] == 1 and result["colocate/asleep_held_bytes"] == 0
    conductor.to_rollout()
    fleet.wait_all("awake", 1)
    control.close()


def test_acks_left_by_an_earlier_learner_count_for_nothing(address: str, fleet: Fleet) -> None:
    """Engines outlive a learner's restart, and so do their acks; the new learner's phase
    numbers start again, and the old acks must not pass for answers to them."""
    control = ZmqBufferClient(address, timeout_s=5.0)
    old = PhaseConductor(control, timeout_s=30.0)
    old.to_rollout()
    old.to_train()                          # phase 2, acked by both engines
    control.heartbeat("rollout-9-1", "rollout", {})   # an engine that died asleep: its ack
    control.set_key(ack_key("rollout-9-1"),           # of phase 2 stays on the buffer
                    control.get_key(ack_key(MEMBERS[0]))[1])
    new = PhaseConductor(control, timeout_s=30.0)
    new.to_rollout()
    result: dict = {}
    train = threading.Thread(target=lambda: result.update(new.to_train()))   # phase 2 again
    train.start()
    fleet.wait_all("asleep", 2)
    assert train.is_alive()                 # the old ack is no answer: it waits for the ghost
    ghost = ZmqBufferClient(address, timeout_s=5.0)   # clients are not thread-safe
    ghost.heartbeat("rollout-9-1", "rollout", {"state": STOPPED})
    ghost.close()
    train.join(30)
    assert result["colocate/not_asleep"] == 1 and result["colocate/engines"] == 3
    new.to_rollout()
    fleet.wait_all("awake", 3)
    control.close()


def test_a_sleeping_engine_lets_go_of_its_receive_buffers(
        address: str, caplog: pytest.LogCaptureFixture) -> None:
    """The weight receiver's buffers (the engine adopted a received update: its weights are
    views into them) go too when the engine sleeps; the next update gets new ones. Each
    pool's size is logged once, not at every step's new allocation."""
    from asyncrl.config.schema import WeightsConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster
    from rollouters.colocate import _WithReceiver
    from rollouters.engines import make_weight_receiver

    clients = [ZmqBufferClient(address, timeout_s=10.0) for _ in range(4)]
    control, receiving, following, beat = clients
    engine = TorchEngine(build_tiny_model(TinyModelConfig(), len(VOCAB), 0), eos_ids=(EOS_ID,),
                         pad_id=PAD_ID, seed=0)
    receiver = make_weight_receiver(engine, receiving, MEMBERS[0])
    moved = {"asleep": threading.Event(), "awake": threading.Event()}
    follower = PhaseFollower(following, MEMBERS[0], _WithReceiver(engine, receiver, 10.0),
                             on_phase=lambda phase: moved[phase].set())
    beat.heartbeat(MEMBERS[0], "rollout", {})
    broadcaster = WeightBroadcaster(control, WeightsConfig(bucket_mb=0.25, alone_mb=0.0,
                                                           timeout_s=10.0))
    caplog.set_level(logging.INFO, logger="asyncrl.weights.receiver")
    try:
        receiver.start()
        follower.start()
        update = build_tiny_model(TinyModelConfig(), len(VOCAB), 1).state_dict()
        assert broadcaster.sync(update, 1)["weights/members"] == 1
        assert receiver.buffer_bytes > 0
        clients.append(ZmqBufferClient(address, timeout_s=10.0))
        conductor = PhaseConductor(clients[-1], timeout_s=10.0)
        metrics = conductor.to_train(1)
        assert engine.asleep and receiver.buffer_bytes == 0   # the receive buffers went too
        assert metrics["colocate/asleep_held_bytes"] == 0
        for version in (2, 3):   # adopting: pools 1, then 0 again, after each sleep
            if version == 3:
                moved["awake"].clear()
                conductor.to_train(version - 1)
                assert engine.asleep and receiver.buffer_bytes == 0
            conductor.to_rollout()
            assert moved["awake"].wait(30)   # the follower woke it; the next update lands
            newer = build_tiny_model(TinyModelConfig(), len(VOCAB), version).state_dict()
            assert broadcaster.sync(newer, version)["weights/members"] == 1
            held = engine.state_dict()
            assert all(torch.equal(held[k], v) for k, v in newer.items() if k in held)
        pools = [r.getMessage() for r in caplog.records if "receive pool" in r.getMessage()
                 and r.levelno == logging.INFO]
        assert len(pools) == 2, pools   # pool 0 and pool 1, once each
    finally:
        broadcaster.close()
        follower.close()
        receiver.stop()
        for client in clients:
            client.close()
