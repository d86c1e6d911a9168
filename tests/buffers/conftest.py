"""Real servers for the buffer suites, on loopback, restartable in place.

- :class:`RedisServer`: a private ``redis-server`` on a free port, AOF on with
  ``appendfsync always`` (so a SIGKILL loses no acknowledged write), in the test's directory;
  restarting reuses port and directory, so the AOF is replayed.
- :class:`RedisClusterServer`: three such servers (cluster mode) joined into one Redis Cluster,
  each master of a third of the slots; the URL names the first node, which does not hold the
  contract runs' slot (checked), so clients must follow redirects. Restarting restarts every
  node. A cluster takes ~2 s to form, so one serves a whole session, each deployment in a
  namespace of its own (same hash tag, so the same slot).
- :class:`BrokerProcess`: the ZMQ broker as ``python -m asyncrl.cli buffer`` on a fixed port
  with a ``buffer.zmq.spill_path``, so it can be killed and started again at the same address;
  its run's token comes in ``ASYNCRL_RUN_TOKEN``, as `asyncrl up` gives it, and the
  deployment's clients carry it.
- ``backend``: parametrized over "zmq", "redis" and "redis-cluster";
  ``backend.start(**config)`` returns a :class:`Deployment` that makes clients through the
  real factory and restarts its server.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from asyncrl.config.load import to_toml
from asyncrl.config.schema import (BufferConfig, Config, LearnerConfig, RedisBufferConfig,
                                   RunConfig, ZmqBufferConfig)
from buffers import BufferClient, make_buffer_client
from buffers.run_token import TOKEN_ENV
from tests.buffers import eventually

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 20.0
RUN_ID = "contract"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


class ServerProcess:
    """A server subprocess (``proc``, made by ``start``) that can be stopped and restarted."""

    proc: subprocess.Popen | None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        self.start()


class RedisServer(ServerProcess):
    """One ``redis-server`` process, bound to 127.0.0.1, that can be stopped and restarted."""

    def __init__(self, directory: Path, extra: Sequence[str] = (), tls: bool = False) -> None:
        self.directory = directory
        self.port = free_port()
        self.extra = list(extra)
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else \
            ["--port", str(self.port)]
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(
            ["redis-server", *ports, "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--logfile", str(self.log), *self.extra], stdin=subprocess.DEVNULL)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self._tail()
            return self.log.exists() and \
                b"Ready to accept connections" in self.log.read_bytes()[offset:]

        eventually(ready, START_TIMEOUT_S, f"redis-server on port {self.port}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


class RedisClusterServer:
    """A Redis Cluster of ``nodes`` masters on loopback, joined with ``CLUSTER ADDSLOTSRANGE``
    and ``CLUSTER MEET`` (what ``redis-cli --cluster create`` sends)."""

    SLOTS = 16384

    def __init__(self, directory: Path, nodes: int = 3) -> None:
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "2000"]
        # The bus port defaults to port + 10000, which may be taken or past 65535.
        self.bus_ports = [free_port() for _ in range(nodes)]
        self.nodes = [RedisServer(directory / f"node{i}", [*extra, "--cluster-port", str(bus)])
                      for i, bus in enumerate(self.bus_ports)]
        self._joined = False

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def _share(self) -> int:
        """Slots per node: :meth:`_join` gives node i the i-th run of this many."""
        return -(-self.SLOTS // len(self.nodes))

    def owner(self, key: str) -> int:
        """Which node is master of ``key``'s slot."""
        return key_slot(key.encode()) // self._share

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            if not self._joined:  # nodes.conf remembers the cluster across restarts
                self._join()
            eventually(self._ready, START_TIMEOUT_S, "the Redis Cluster's state ok on every node")
        except BaseException:
            self.stop(signal.SIGKILL)  # no node outlives a cluster that failed to form
            raise

    def _admin(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True)

    def _join(self) -> None:
        share = self._share
        for i, node in enumerate(self.nodes):
            with self._admin(node) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share,
                                       min(self.SLOTS, (i + 1) * share) - 1)
        with self._admin(self.nodes[0]) as first:
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        self._joined = True

    def _ready(self) -> bool:
        for node in self.nodes:
            with self._admin(node) as client:
                info = client.cluster("info")
            if info.get("cluster_state") != "ok" or \
                    int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                return False
        return True

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        for node in self.nodes:
            node.stop(sig)

    def restart(self, kill: bool = False) -> None:
        self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        self.start()


class BrokerProcess(ServerProcess):
    """The ZMQ broker through the CLI, on a fixed port, spilling to ``directory/spill``."""

    def __init__(self, directory: Path, config: BufferConfig, groups_per_step: int) -> None:
        self.directory = directory
        self.config_path = directory / "buffer.toml"
        self.address_file = directory / "buffer.addr"
        self.token = secrets.token_hex(16)
        cfg = Config(run=RunConfig(name=RUN_ID, output_dir=directory), buffer=config,
                     learner=LearnerConfig(groups_per_step=groups_per_step))
        self.config_path.write_text(to_toml(cfg))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.address_file.unlink(missing_ok=True)
        log = (self.directory / "broker.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "buffer", str(self.config_path),
             "--address-file", str(self.address_file)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**child_env(), TOKEN_ENV: self.token}, cwd=ROOT)
        log.close()

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, \
                (self.directory / "broker.log").read_text(errors="replace")[-2000:]
            return self.address_file.exists()

        eventually(ready, START_TIMEOUT_S, "the ZMQ broker's address file")


@dataclass
class Deployment:
    """One running buffer (a broker, or a Redis) and the clients opened on it."""

    name: str
    config: BufferConfig
    groups_per_step: int
    server: RedisServer | RedisClusterServer | BrokerProcess
    address: str | None = None
    clients: list[BufferClient] = field(default_factory=list)
    owns_server: bool = True  # False: a shared server outlives this deployment

    @property
    def token(self) -> str | None:
        """The run's token its clients carry (a ZMQ broker's; Redis has none)."""
        return getattr(self.server, "token", None)

    def client(self, **overrides: Any) -> BufferClient:
        """A client through the real factory; ``overrides`` change client-side config."""
        config = self.config.model_copy(update=overrides)
        client = make_buffer_client(config, self.address, run_id=RUN_ID,
                                    groups_per_step=self.groups_per_step, token=self.token)
        self.clients.append(client)
        return client

    def drop(self, client: BufferClient) -> None:
        """Close one client now (a consumer going away) and forget it."""
        self.clients.remove(client)
        client.close()

    def restart(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with ``kill``) and start it again in place."""
        self.server.restart(kill)

    def spec(self) -> str:
        """JSON that lets a subprocess open the same kind of client."""
        return json.dumps({"config": self.config.model_dump(mode="json"), "address": self.address,
                           "run_id": RUN_ID, "groups_per_step": self.groups_per_step,
                           "token": self.token})

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.owns_server:
            self.server.stop(signal.SIGKILL)


class Backend:
    """Starts deployments of one backend; stops all of them at teardown. "redis-cluster"
    deployments share ``cluster``."""

    def __init__(self, name: str, directory: Path,
                 cluster: RedisClusterServer | None = None,
                 staleness_mode: str = "drop") -> None:
        self.name = name
        self.directory = directory
        self.cluster = cluster
        self.staleness_mode = staleness_mode   # buffer.staleness_mode unless a test sets it
        self.deployments: list[Deployment] = []

    def start(self, groups_per_step: int = 2, **overrides: Any) -> Deployment:
        directory = self.directory / f"{self.name}-{len(self.deployments)}"
        directory.mkdir(parents=True)
        fields = {"max_staleness": 1, "request_timeout_s": 5.0,
                  "staleness_mode": self.staleness_mode, **overrides}
        if self.name == "redis":
            server = RedisServer(directory)
            config = BufferConfig(type="redis", redis=RedisBufferConfig(url=server.url), **fields)
            server.start()
            deployment = Deployment(self.name, config, groups_per_step, server)
        elif self.name == "redis-cluster":
            assert self.cluster is not None
            tag = f"asyncrl:{RUN_ID}"
            assert self.cluster.owner(tag) != 0  # the URL's node must redirect
            config = BufferConfig(type="redis", redis=RedisBufferConfig(
                url=self.cluster.url, namespace=f"{{{tag}}}:{uuid.uuid4().hex[:8]}"), **fields)
            deployment = Deployment(self.name, config, groups_per_step, self.cluster,
                                    owns_server=False)
        else:
            config = BufferConfig(zmq=ZmqBufferConfig(port=free_port(),
                                                      spill_path=str(directory / "spill")),
                                  **fields)
            broker = BrokerProcess(directory, config, groups_per_step)
            broker.start()
            deployment = Deployment(self.name, config, groups_per_step, broker,
                                    address=f"tcp://127.0.0.1:{config.zmq.port}")
        self.deployments.append(deployment)
        return deployment

    def close(self) -> None:
        for deployment in self.deployments:
            deployment.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServer]:
    cluster = RedisClusterServer(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()  # stops what it started if it fails
    try:
        yield cluster
    finally:
        cluster.stop(signal.SIGKILL)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The contract in pace mode runs on the ZMQ broker and on Redis (test_contract's
    ``pytest_generate_tests`` says why); the Redis Cluster's pace runs are not collected,
    unless ``ASYNCRL_FULL_CONTRACT=1`` asks for the whole matrix."""
    if os.environ.get("ASYNCRL_FULL_CONTRACT") == "1":
        return
    items[:] = [item for item in items if "[pace-redis-cluster" not in item.nodeid
                or "test_contract.py" not in item.nodeid]


@pytest.fixture
def staleness_mode() -> str:
    """``buffer.staleness_mode`` of the deployments; the contract suite parametrizes it."""
    return "drop"


@pytest.fixture(params=["zmq", "redis", "redis-cluster"])
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            staleness_mode: str) -> Iterator[Backend]:
    cluster = request.getfixturevalue("redis_cluster") if request.param == "redis-cluster" \
        else None
    backend = Backend(request.param, tmp_path, cluster, staleness_mode)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def zmq(tmp_path: Path) -> Iterator[Backend]:
    """The ZMQ backend alone, for what only it does (requests in flight on one client)."""
    backend = Backend("zmq", tmp_path)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private, started ``redis-server`` (AOF on); add flags with ``redis_server.extra``
    and ``restart()`` to apply them."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)
