"""CURVE authentication: only clients whose public key is authorised get any service."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from buffers.zmq_auth import generate_curve_keys
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from tests.unit.test_zmq_buffer import make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def curve_broker(tmp_path) -> tuple[str, Path]:
    keys = generate_curve_keys(tmp_path / "keys", clients=("client", "learner"))
    config = BufferConfig(zmq=ZmqBufferConfig(port=0, auth="curve",
                                              curve_keys_dir=str(keys)))
    address, stop = start_broker_thread(config, groups_per_step=4)
    yield address, keys
    stop()


def test_generated_layout(tmp_path):
    keys = generate_curve_keys(tmp_path, clients=("a",))
    names = {p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file()}
    assert names == {"server.key", "server.key_secret", "a.key", "a.key_secret",
                     "clients/a.key"}
    assert (keys / "server.key_secret").stat().st_mode & 0o077 == 0
    generate_curve_keys(tmp_path, clients=("a",))  # idempotent: keys are kept
    assert (keys / "clients" / "a.key").read_bytes() == (keys / "a.key").read_bytes()


def test_authorised_clients_are_served(curve_broker):
    address, keys = curve_broker
    config = BufferConfig(zmq=ZmqBufferConfig(auth="curve", curve_keys_dir=str(keys)))
    with ZmqBufferClient.from_config(config, address) as producer, \
            ZmqBufferClient(address, timeout_s=5, curve_keys_dir=str(keys),
                            curve_name="learner") as learner:
        assert producer.put("w", make_group("a")).accepted
        batch = learner.get_batch("l", 1, 0, timeout_s=2.0)
        assert [g.group_id for g in batch.groups] == ["a"]
        assert learner.status()["auth"] == "curve"


def test_clients_without_or_with_unknown_keys_get_no_service(curve_broker, tmp_path):
    address, keys = curve_broker
    stranger = generate_curve_keys(tmp_path / "stranger")  # valid keys, never authorised
    shutil.copyfile(keys / "server.key", stranger / "server.key")
    with ZmqBufferClient(address, timeout_s=0.5) as plain, \
            ZmqBufferClient(address, timeout_s=0.5, curve_keys_dir=str(stranger)) as unknown, \
            ZmqBufferClient(address, timeout_s=5, curve_keys_dir=str(keys)) as friend:
        for intruder in (plain, unknown):
            with pytest.raises(TimeoutError):
                intruder.put("w", make_group("evil"))
            with pytest.raises(TimeoutError):
                intruder.status()
        status = friend.status()  # the broker kept serving the authorised client
        assert status["accepted"] == 0 and status["members"] == {}
        assert friend.put("w", make_group("good")).accepted
