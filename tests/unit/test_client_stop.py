"""A buffer client given its role's stop event stops waiting for a broker that does not answer
once the event is set, instead of waiting out ``request_timeout_s`` and its re-sends; a live
broker is still waited for. Real ZMQ sockets throughout, and a real learner process whose
broker is SIGKILLed: before, such a learner took about two minutes to exit after SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import zmq

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from buffers import BufferStopped, stopped_by
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import NoReply, ZmqBufferClient
from tests.integration.conftest import QUICKSTART, Processes, processes, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)

STOP_WITHIN_S = 1.0  # STOP_POLL_S + STOP_GRACE_S, and then some for a busy machine
SLOW = {"timeout_s": 30.0, "reconnect_s": 60.0}  # the defaults' order: never waited out here


@pytest.fixture
def silent_broker() -> Iterator[tuple[str, zmq.Socket]]:
    """A ROUTER that receives requests and never answers: a hung broker."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}", router
    router.close()
    context.term()


def seconds_to_fail(future: Future, error: type[BaseException]) -> float:
    start = time.monotonic()
    with pytest.raises(error):
        future.result(timeout=10)
    return time.monotonic() - start


@pytest.mark.parametrize("request_", ["heartbeat", "get_batch"])
def test_a_stop_ends_the_wait_for_a_broker_that_never_answers(silent_broker, request_):
    address, router = silent_broker
    stop = threading.Event()
    calls = {"heartbeat": lambda c: c.heartbeat("learner-0", "learner", {}),
             "get_batch": lambda c: c.get_batch("learner-0", 1, 0, timeout_s=0.2)}
    with ZmqBufferClient(address, stop=stop, **SLOW) as client, ThreadPoolExecutor(1) as pool:
        future = pool.submit(calls[request_], client)
        assert router.poll(5000), "the request never reached the broker"
        router.recv_multipart()  # it is waiting for the reply now
        stop.set()
        assert seconds_to_fail(future, BufferStopped) < STOP_WITHIN_S
    error = future.exception()
    assert isinstance(error, TimeoutError) and not isinstance(error, NoReply)
    assert address in str(error) and request_ in str(error)


def test_a_stop_ends_the_resends_to_a_broker_gone_for_good(caplog):
    from asyncrl.net import free_port

    address, stop_broker = start_broker_thread(
        BufferConfig(zmq=ZmqBufferConfig(port=free_port())), 1)
    stop = threading.Event()
    caplog.set_level(logging.DEBUG, logger="buffers.zmq_client")  # each re-send (the outage
    # itself is one warning, buffers.outage)
    with ZmqBufferClient(address, timeout_s=0.2, reconnect_s=60, stop=stop) as client, \
            ThreadPoolExecutor(1) as pool:
        assert client.status()["version"] == 0
        stop_broker()
        future = pool.submit(client.status)  # re-sent for a minute without the stop
        wait_for(lambda: "re-sending" in caplog.text, 5, "a re-send", poll_s=0.02)
        stop.set()
        assert seconds_to_fail(future, BufferStopped) < STOP_WITHIN_S


def test_a_stopping_client_still_gets_a_live_brokers_answers():
    """A stopping role's last words (a worker's final heartbeat) and a long poll in flight
    (the learner's wait for data) are still answered: only an unanswered wait ends early."""
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)), 1)
    stop = threading.Event()
    stop.set()
    try:
        with ZmqBufferClient(address, stop=stop, **SLOW) as client:
            assert client.heartbeat("rollout-0", "rollout", {"state": "stopped"})["version"] == 0
            start = time.monotonic()
            assert client.get_batch("learner-0", 1, 0, timeout_s=1.0) is None
            assert time.monotonic() - start >= 1.0  # the broker's answer, not a give-up
    finally:
        stop_broker()


def test_an_unset_stop_event_changes_no_timeout(silent_broker):
    address, _ = silent_broker
    with ZmqBufferClient(address, timeout_s=0.6, stop=threading.Event()) as client:
        start = time.monotonic()
        with pytest.raises(NoReply):
            client.status()
        assert 0.6 <= time.monotonic() - start < 0.6 + STOP_WITHIN_S


def test_stopped_by_follows_explicit_causes_only():
    stopped = BufferStopped("stopping")
    try:
        raise RuntimeError("fetching the batch of version 3 failed") from stopped
    except RuntimeError as exc:
        assert stopped_by(exc) is stopped
    try:
        try:
            raise stopped
        except BufferStopped:
            raise ValueError("a real failure while cleaning up") from None
    except ValueError as exc:
        assert stopped_by(exc) is None


@pytest.mark.timeout(90)
def test_a_learner_whose_broker_was_killed_exits_promptly_on_sigterm(
        processes: Processes, tmp_path) -> None:  # noqa: F811
    sets = [item for key in ("learner.backend=sim", "rollout.engine=sim",
                             "weights.transport=sim", "eval.every_steps=0",
                             f"run.output_dir={tmp_path}", "run.name=orphan")
            for item in ("--set", key)]
    broker, address = processes.start_buffer(str(QUICKSTART), *sets)
    learner = processes.start("learner", "learner", str(QUICKSTART), *sets, "--buffer", address)
    with ZmqBufferClient(address, timeout_s=5) as client:
        wait_for(lambda: client.status()["members"].get("learner-0", {}).get("info", {})
                 .get("state") == "waiting for data", 60, "the learner to wait for data")
    broker.send_signal(signal.SIGKILL)
    broker.wait()
    wait_for(lambda: "re-sending" in processes.log("learner"), 30,
             "the learner's requests to the dead broker")
    stopped = time.monotonic()
    learner.send_signal(signal.SIGTERM)
    assert processes.wait(learner, 30) == 0, processes.log("learner")
    assert time.monotonic() - stopped < 10, processes.log("learner")
    assert "Traceback" not in processes.log("learner"), processes.log("learner")


def test_a_stopping_roles_weight_receiver_ends_without_a_traceback(silent_broker, caplog):
    """The receiver's thread polls announcements through its own client: a stop with the
    broker gone ends it quietly, instead of a traceback per poll until it is joined."""
    from asyncrl.weights.receiver import WeightReceiver

    address, _ = silent_broker
    stop = threading.Event()
    stop.set()
    with ZmqBufferClient(address, stop=stop, **SLOW) as control:
        receiver = WeightReceiver(control, "rollout-0", lambda named, version: None, poll_s=0.1)
        with caplog.at_level(logging.INFO):
            receiver.start()
            wait_for(lambda: not any(t.name == "weights-rollout-0"
                                     for t in threading.enumerate()), 5, "the thread to end")
        receiver.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
