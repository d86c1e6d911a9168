"""A rollout worker's heartbeat runs on a thread of its own (:mod:`rollouters.heartbeat`),
against a real ZMQ broker: the worker is heard from while its loop is busy, with the metrics
the loop last handed over, and nothing is sent after ``stop``."""

from __future__ import annotations

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from rollouters.heartbeat import Heartbeat
from tests.integration.conftest import wait_for


def test_heartbeats_go_on_while_the_loop_is_busy_and_end_at_stop() -> None:
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    client, watcher = ZmqBufferClient(address, 10.0), ZmqBufferClient(address, 10.0)
    beat = Heartbeat(client, "rollout-0-1", {"engine_version": 0}, period_s=0.05)

    def info() -> dict:
        return watcher.status()["members"].get("rollout-0-1", {}).get("info", {})

    try:
        beat.start()  # the loop is "busy": this thread never heartbeats itself
        beat.update({"engine_version": 3, "groups": 8})
        wait_for(lambda: info() == {"engine_version": 3, "groups": 8}, 10.0,
                 "the thread's heartbeat with the loop's latest metrics", poll_s=0.05)
        assert beat.reply.get("run_status") is not None, "the run state comes back"
        beat.stop()
        watcher.heartbeat("rollout-0-1", "rollout", {"state": "stopped"})  # the last word
        beat.stop()  # idempotent
        assert info() == {"state": "stopped"}
    finally:
        beat.stop()
        client.close()
        watcher.close()
        stop_broker()
