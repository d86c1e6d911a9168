"""Weight sync over real gloo, a real broker and real processes.

This test process is learner rank 0 (it owns the broker thread and the broadcaster); receiver
processes (``python -m tests.integration.test_weight_broadcast receiver ...``) each hold a
differently initialised tiny Qwen2, heartbeat as rollout members and copy received tensors into
it by name. After each version they write their whole state dict to a safetensors file, which
the test compares with the learner's, bit for bit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = ("engine-a", "engine-b")
LATE = "engine-c"  # joins after engine-b dies; fails to load one version, then recovers
LATE_FAILS_AT = 5
TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)


def tiny_model(seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def result_file(out_dir: Path, member: str, version: int) -> Path:
    return out_dir / f"{member}-v{version}.safetensors"


# --- the receiver process ---------------------------------------------------------------------

def receiver_main(address: str, member: str, out_dir: Path, seed: int, fail_at: int) -> None:
    """Heartbeat as a rollout member and apply every update to a local model until SIGTERM;
    loading version ``fail_at`` raises (an engine that cannot load: it never acks) and pauses
    the heartbeats until the test writes ``test/resume/<member>``, so that the test decides
    when the evicted engine is heard from again (no race with the heartbeat period)."""
    from safetensors.torch import save_file

    from asyncrl.weights.receiver import WeightReceiver
    from buffers.zmq_client import ZmqBufferClient

    torch.set_num_threads(1)
    model = tiny_model(seed)
    params = model.state_dict()

    refused = threading.Event()

    def apply(named: dict[str, torch.Tensor], version: int) -> None:
        if version == fail_at:
            refused.set()
            raise RuntimeError(f"test: {member} refuses version {version}")
        with torch.no_grad():
            for name, tensor in named.items():
                params[name].copy_(tensor)
        path = result_file(out_dir, member, version)
        save_file({k: v.clone() for k, v in model.state_dict().items()}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # the learner may read it as soon as we ack

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    beats, own = ZmqBufferClient(address, timeout_s=10.0), ZmqBufferClient(address, 10.0)
    receiver = WeightReceiver(own, member, apply)
    beats.heartbeat(member, "rollout", {"engine_version": -1, "weights": "ready"})
    receiver.start()
    beats.set_key(f"test/ready/{member}", {"pid": os.getpid()})
    while not stop.wait(0.2):  # heartbeat pacing, not synchronisation
        if refused.is_set() and beats.get_key(f"test/resume/{member}", 0, 0.0) is None:
            continue
        beats.heartbeat(member, "rollout", {"engine_version": receiver.last_version,
                                            "weights": "ready"})
    receiver.stop()
    beats.close()
    own.close()


# --- the learner side (this process) ----------------------------------------------------------

def start_receiver(address: str, member: str, out_dir: Path, seed: int,
                   fail_at: int = -1) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with (out_dir / f"{member}.log").open("wb") as log:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_weight_broadcast", "receiver",
             address, member, str(out_dir), str(seed), str(fail_at)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def assert_same_state(expected: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import load_file

    got = load_file(path)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), f"{path.name}: {name} differs"


def perturb(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One fake optimizer step; returns the new state dict."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    return model.state_dict()


def sync_and_check(broadcaster, model: torch.nn.Module, version: int, members: list[str],
                   out_dir: Path) -> dict[str, float]:
    """Perturb, sync ``version``, check every engine in ``members`` holds it exactly."""
    state = perturb(model)
    metrics = broadcaster.sync(state, version)
    logger.info("sync v%d: %s", version, metrics)
    assert metrics["weights/members"] == len(members)
    for member in members:
        assert_same_state(state, result_file(out_dir, member, version))
    return metrics


def dump_logs(out_dir: Path) -> None:
    for log in sorted(out_dir.glob("*.log")):
        logger.error("%s:\n%s", log.name, log.read_text(errors="replace")[-4000:])


class LearnerSide:
    """This process as learner rank 0: a broker thread, a control client, the broadcaster
    under test and the receiver processes it starts; on exit it stops all of them, after
    dumping the receivers' logs if the test failed."""

    def __init__(self, out_dir: Path, heartbeat_timeout_s: float, weights_timeout_s: float):
        from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
        from asyncrl.weights.broadcaster import WeightBroadcaster
        from buffers.zmq_broker import start_broker_thread
        from buffers.zmq_client import ZmqBufferClient

        torch.set_num_threads(1)
        self.out_dir = out_dir
        self.address, self._stop_broker = start_broker_thread(
            BufferConfig(zmq=ZmqBufferConfig(port=0), heartbeat_timeout_s=heartbeat_timeout_s),
            groups_per_step=1)
        self.control = ZmqBufferClient(self.address, timeout_s=10.0)
        self.procs: dict[str, subprocess.Popen] = {}
        self.broadcaster = WeightBroadcaster(
            self.control, WeightsConfig(bucket_mb=0.01, timeout_s=weights_timeout_s))

    def start(self, member: str, seed: int, fail_at: int = -1) -> None:
        self.procs[member] = start_receiver(self.address, member, self.out_dir, seed, fail_at)

    def wait_ready(self, member: str) -> None:
        from asyncrl.weights.rendezvous import await_key

        assert await_key(self.control, f"test/ready/{member}", lambda v: True,
                         time.monotonic() + 60.0), f"{member} never came up"

    def synced_at_version_1(self, members: list[str]) -> tuple[Any, torch.nn.Module]:
        """Start ``members`` (seeds 1, 2, ...), deliver version 1 to all; the broadcaster and
        the learner's model."""
        for seed, member in enumerate(members, start=1):
            self.start(member, seed)
            self.wait_ready(member)
        model = tiny_model(seed=0)
        sync_and_check(self.broadcaster, model, 1, members, self.out_dir)
        return self.broadcaster, model

    def kill(self, member: str) -> None:
        self.procs[member].send_signal(signal.SIGKILL)
        self.procs[member].wait()

    def __enter__(self) -> LearnerSide:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            dump_logs(self.out_dir)
        try:
            self.broadcaster.close()
            stop_processes(list(self.procs.values()))
            self.control.close()
        finally:
            self._stop_broker()


@pytest.mark.timeout(120)
def test_broadcast_versions_evict_and_rejoin(tmp_path: Path) -> None:
    with LearnerSide(tmp_path, heartbeat_timeout_s=60.0, weights_timeout_s=TIMEOUT_S) as side:
        for seed, member in enumerate(MEMBERS, start=1):
            side.start(member, seed)
        for member in MEMBERS:
            side.wait_ready(member)
        broadcaster, model = side.broadcaster, tiny_model(seed=0)
        assert broadcaster.members() == list(MEMBERS)
        for version in (1, 2):
            metrics = sync_and_check(broadcaster, model, version, list(MEMBERS), tmp_path)
            assert metrics["weights/evicted"] == 0 and metrics["weights/buckets"] > 3
            assert metrics["weights/epoch"] == 1, "the group is reused while members stay"

        side.kill(MEMBERS[1])  # still "alive" on the broker for 60 s
        metrics = sync_and_check(broadcaster, model, 3, [MEMBERS[0]], tmp_path)
        assert metrics["weights/evicted"] == 1
        assert metrics["timing/weight_sync"] < 3 * TIMEOUT_S, "the learner must not hang"
        assert broadcaster.members() == [MEMBERS[0]], "the dead engine stays out"

        side.start(LATE, seed=9, fail_at=LATE_FAILS_AT)
        side.wait_ready(LATE)
        metrics = sync_and_check(broadcaster, model, 4, [MEMBERS[0], LATE], tmp_path)
        assert metrics["weights/evicted"] == 0 and metrics["weights/epoch"] > 3, "new epoch"
        metrics = sync_and_check(broadcaster, model, 5, [MEMBERS[0]], tmp_path)
        assert metrics["weights/evicted"] == 1, "an engine that never acks is evicted"
        assert broadcaster.members() == [MEMBERS[0]], "out until it heartbeats again"
        side.control.set_key(f"test/resume/{LATE}", {"resume": True})
        wait_for(lambda: broadcaster.members() == [MEMBERS[0], LATE], 10.0, "a heartbeat")
        metrics = sync_and_check(broadcaster, model, 6, [MEMBERS[0], LATE], tmp_path)
        assert metrics["weights/evicted"] == 0, "a live evicted engine is taken back"


@pytest.mark.timeout(90)
def test_killed_engine_costs_the_heartbeat_timeout_not_the_weights_timeout(
        tmp_path: Path) -> None:
    """An engine SIGKILLed just before a sync is still listed alive (its heartbeat timeout has
    not passed), so the sync's new epoch waits for its join: the wait ends as soon as the
    buffer reports it dead, far within ``weights.timeout_s``, the others get the version, and
    the engine restarted under a new name (as a supervisor restarts it) joins the next sync."""
    heartbeat_timeout_s = 3.0
    survivor, victim, restarted = "engine-a", "engine-b-1", "engine-b-2"
    with LearnerSide(tmp_path, heartbeat_timeout_s, weights_timeout_s=60.0) as side:
        broadcaster, model = side.synced_at_version_1([survivor, victim])

        side.kill(victim)
        assert broadcaster.members() == [survivor, victim], "dead, not yet known to be"
        metrics = sync_and_check(broadcaster, model, 2, [survivor], tmp_path)
        assert metrics["weights/evicted"] == 1
        assert metrics["timing/weight_sync"] < heartbeat_timeout_s + 10.0, \
            "the sync must end at the buffer's verdict, not at weights.timeout_s"

        side.start(restarted, seed=3)
        side.wait_ready(restarted)
        sync_and_check(broadcaster, model, 3, [survivor, restarted], tmp_path)


@pytest.mark.timeout(90)
def test_an_engine_its_supervisor_reports_dead_is_let_go_at_once(tmp_path: Path) -> None:
    """The rollout role's supervisor reports a worker that died as stopped (what its last
    heartbeat would have said, ``rollouters.worker.report_crashed``): the next sync goes on
    without it at once, with the heartbeat timeout far away."""
    from asyncrl.config import Config
    from rollouters.worker import member_name, report_crashed

    survivor, victim = "engine-a", member_name(1, 999_999)
    with LearnerSide(tmp_path, heartbeat_timeout_s=60.0, weights_timeout_s=60.0) as side:
        broadcaster, model = side.synced_at_version_1([survivor, victim])
        side.kill(victim)
        report_crashed(Config(), side.address, 1, 999_999, "killed by SIGKILL")
        assert broadcaster.members() == [survivor]
        metrics = sync_and_check(broadcaster, model, 2, [survivor], tmp_path)
        assert metrics["timing/weight_sync"] < 10.0, "not the heartbeat timeout (60 s)"


class EvictionLog(logging.Handler):
    """The broadcaster's warnings that evict an engine, each with when it was logged
    (``time.monotonic``), read straight from its logger: the console line a user sees."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[float, str]] = []
        self._logger = logging.getLogger("asyncrl.weights.broadcaster")

    def emit(self, record: logging.LogRecord) -> None:
        if "evict" in record.getMessage():
            self.lines.append((time.monotonic(), record.getMessage()))

    def __enter__(self) -> EvictionLog:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        self._logger.removeHandler(self)


@pytest.mark.timeout(120)
def test_frozen_engine_is_evicted_within_the_timeout_and_rejoins(tmp_path: Path) -> None:
    """An engine SIGSTOPped between two updates is alive to the buffer (its heartbeat timeout
    is 60 s) but takes no part in the next update. It is evicted, named as frozen, within
    ``weights.timeout_s`` of the update's start; the two others get that version in the same
    sync, one resend later, although one of them receives from the frozen engine in gloo's
    broadcast tree (ranks 1 and 3). SIGCONTinued, it heartbeats again and rejoins at the next
    update. Before the fix, the first attempt's collectives ran into the group's timeout,
    naming nobody, and the retry waited another timeout for the frozen engine's join."""
    victim, others = "engine-a", ["engine-b", "engine-c"]  # sorted: the victim is rank 1
    resend_s = 3.0  # margin for the healthy engines: a new epoch's handshake and one resend
    with LearnerSide(tmp_path, heartbeat_timeout_s=60.0, weights_timeout_s=TIMEOUT_S) as side, \
            EvictionLog() as evictions:
        broadcaster, model = side.synced_at_version_1([victim, *others])
        frozen = side.procs[victim]
        frozen.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            metrics = sync_and_check(broadcaster, model, 2, others, tmp_path)
            took = time.monotonic() - started
        finally:
            frozen.send_signal(signal.SIGCONT)
        [(evicted_at, line)] = evictions.lines
        assert evicted_at - started < TIMEOUT_S, \
            f"{line!r} came {evicted_at - started:.1f} s after the update's start"
        assert took < TIMEOUT_S + resend_s and metrics["weights/evicted"] == 1, metrics
        assert line.startswith(f"weights: evicted {victim}: no heartbeat for ") and \
            line.endswith(" s during version 2 (frozen?)"), line
        assert list(broadcaster.evictions()) == [victim]

        wait_for(lambda: broadcaster.members() == [victim, *others], 30.0, "its heartbeat")
        assert broadcaster.evictions() == {}, "taken back once heard from"
        metrics = sync_and_check(broadcaster, model, 3, [victim, *others], tmp_path)
        assert metrics["weights/evicted"] == 0


@pytest.mark.timeout(60)
def test_receiver_thread_waits_stops_and_leaves(tmp_path: Path) -> None:
    """Both ends in one process: ``wait_for_version``, a prompt ``stop``, mixed dtypes, and a
    sync with nobody to send to."""
    from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster
    from asyncrl.weights.receiver import WeightReceiver
    from buffers.zmq_broker import start_broker_thread
    from buffers.zmq_client import ZmqBufferClient

    torch.set_num_threads(1)
    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    control, beats = ZmqBufferClient(address, 10.0), ZmqBufferClient(address, 10.0)
    own = ZmqBufferClient(address, 10.0)  # the receiver thread's own client
    got: dict[int, dict[str, torch.Tensor]] = {}
    receiver = WeightReceiver(  # the tensors view reused buffers: keep copies
        own, "engine-t",
        lambda named, version: got.__setitem__(version, {k: v.clone() for k, v in named.items()}))
    broadcaster = WeightBroadcaster(control, WeightsConfig(bucket_mb=0.001, timeout_s=TIMEOUT_S))
    state = {"a": torch.randn(300), "b": torch.randn(7, 5).to(torch.bfloat16),
             "c": torch.arange(10), "d": torch.randn(600, 3)}
    try:
        assert broadcaster.sync(state, 1)["weights/members"] == 0, "no engines: nothing to do"
        beats.heartbeat("engine-t", "rollout", {"engine_version": -1, "weights": "ready"})
        receiver.start()
        metrics = broadcaster.sync(state, 2)
        assert metrics["weights/members"] == 1 and metrics["weights/buckets"] >= 3
        assert receiver.wait_for_version(2, timeout=TIMEOUT_S) and receiver.last_version == 2
        assert not receiver.wait_for_version(3, timeout=0.05)
        assert list(got[2]) == list(state)
        assert all(torch.equal(got[2][k], v) and got[2][k].dtype == v.dtype
                   for k, v in state.items())
    finally:
        broadcaster.close()
        started = time.monotonic()
        receiver.stop()
        assert time.monotonic() - started < 1.5, "stop must be prompt when idle"
        for client in (control, beats, own):
            client.close()
        stop_broker()


@pytest.mark.timeout(60)
def test_unpadded_plan_and_reused_buffers() -> None:
    """``align=1`` (SGLang's layout: misaligned tensors are copied out on arrival) over real
    gloo, and three versions through the same staging and receive buffers: each arrives
    exactly, although the buffers it passed through held the previous one."""
    from asyncrl.config.schema import WeightsConfig
    from asyncrl.weights.receiver import WeightReceiver

    torch.set_num_threads(1)
    got: dict[int, dict[str, torch.Tensor]] = {}

    def receiver_for(own: Any) -> WeightReceiver:
        return WeightReceiver(own, "engine-u", lambda named, version: got.__setitem__(
            version, {k: v.clone() for k, v in named.items()}))

    with in_process_sync("engine-u", receiver_for,
                         WeightsConfig(bucket_mb=0.0005, timeout_s=TIMEOUT_S), align=1,
                         beat={"weights": "ready"}) as (broadcaster, receiver):
        pools = []
        for version in (1, 2, 3):
            state = {"a": torch.randn(3), "b": torch.randn(7, 5).to(torch.bfloat16),
                     "c": torch.arange(10) * version, "d": torch.randn(100, 3)}
            assert broadcaster.sync(state, version)["weights/members"] == 1
            assert receiver.wait_for_version(version, timeout=TIMEOUT_S)
            assert all(torch.equal(got[version][k], v) for k, v in state.items()), version
            pools.append(receiver._pools[0])
        assert pools[0] is not None and pools[0] is pools[1] is pools[2], "one pool, reused"


def test_a_transport_that_pays_per_bucket_gets_every_tensor_packed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ipc pays ~0.5 ms a bucket whatever its size (H200), so once a group's transport says
    ``packs_every_tensor`` the next updates pack even the tensors ``weights.alone_mb`` would
    send alone; the first, announced before the group existed, goes by the setting. gloo
    stands in for ipc here (no GPU): the receiver follows whichever plan is announced."""
    from asyncrl.config.schema import WeightsConfig
    from asyncrl.weights.group import GlooTransport
    from asyncrl.weights.receiver import WeightReceiver

    torch.set_num_threads(1)
    monkeypatch.setattr(GlooTransport, "packs_every_tensor", True)
    got: dict[int, dict[str, torch.Tensor]] = {}

    def receiver_for(own: Any) -> WeightReceiver:
        return WeightReceiver(own, "engine-p", lambda named, version: got.__setitem__(
            version, {k: v.clone() for k, v in named.items()}))

    weights = WeightsConfig(bucket_mb=1.0, alone_mb=0.01, timeout_s=TIMEOUT_S)
    with in_process_sync("engine-p", receiver_for, weights,
                         beat={"weights": "ready"}) as (broadcaster, receiver):
        buckets = []
        for version in (1, 2, 3):
            state = {f"w{i}": torch.randn(64, 64) * version for i in range(4)}   # 16 KB each
            metrics = broadcaster.sync(state, version)
            assert metrics["weights/members"] == 1
            assert receiver.wait_for_version(version, timeout=TIMEOUT_S)
            assert all(torch.equal(got[version][k], v) for k, v in state.items()), version
            buckets.append(metrics["weights/buckets"])
        assert buckets == [4, 1, 1], buckets


@contextmanager
def in_process_sync(member: str, receiver_for: Callable[[Any], Any], weights: Any,
                    align: int | None = None, beat: dict[str, Any] | None = None
                    ) -> Iterator[tuple[Any, Any]]:
    """Both ends in this process: a broker thread, the broadcaster (``weights``, ``align``) and
    the receiver ``receiver_for`` makes on a client of its own, started with ``member``
    heartbeating as a rollout member (``beat``: more of its heartbeat); all stopped on exit."""
    from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster
    from buffers.zmq_broker import start_broker_thread
    from buffers.zmq_client import ZmqBufferClient

    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    control, beats = ZmqBufferClient(address, 10.0), ZmqBufferClient(address, 10.0)
    own = ZmqBufferClient(address, 10.0)  # the receiver thread's own client
    receiver = receiver_for(own)
    broadcaster = WeightBroadcaster(control, weights,
                                    **({} if align is None else {"align": align}))
    try:
        beats.heartbeat(member, "rollout", {"engine_version": -1, **(beat or {})})
        receiver.start()
        yield broadcaster, receiver
    finally:
        broadcaster.close()
        receiver.stop()
        for client in (control, beats, own):
            client.close()
        stop_broker()


def engine_sync(engine: Any, member: str, timeout_s: float) -> Any:
    """:func:`in_process_sync` around a real engine and its own receiver
    (:func:`rollouters.engines.make_weight_receiver`)."""
    from asyncrl.config.schema import WeightsConfig
    from rollouters.engines import make_weight_receiver

    return in_process_sync(member, lambda own: make_weight_receiver(engine, own, member),
                           WeightsConfig(bucket_mb=0.05, timeout_s=timeout_s))


@pytest.mark.timeout(60)
def test_adopting_engine_alternates_receive_pools() -> None:
    """``adopt=True`` with a real TorchEngine over real gloo: every version becomes the
    engine's parameters without a copy, and consecutive versions land in different pools, so
    a receive never writes into the tensors the engine is generating with."""
    from asyncrl.config.schema import TinyModelConfig
    from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model
    from rollouters.engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(build_tiny_model(TinyModelConfig(), len(VOCAB), 0), (EOS_ID,), PAD_ID)
    with engine_sync(engine, "engine-a", TIMEOUT_S) as (broadcaster, receiver):

        def pool_of(ptr: int) -> int:
            starts = [pool.slot(0).data_ptr() for pool in receiver._pools]
            ends = [s + pool.nbytes for s, pool in zip(starts, receiver._pools)]
            return next(i for i, (s, e) in enumerate(zip(starts, ends)) if s <= ptr < e)

        ptrs = []
        for version in (1, 2, 3):
            state = build_tiny_model(TinyModelConfig(), len(VOCAB), version).state_dict()
            assert broadcaster.sync(state, version)["weights/members"] == 1
            assert receiver.wait_for_version(version, timeout=TIMEOUT_S)
            params = dict(engine.model.named_parameters())
            assert engine.version == version
            assert all(torch.equal(params[k], v) for k, v in state.items() if k in params)
            ptrs.append([p.data_ptr() for p in params.values()])
        homes = [{pool_of(ptr) for ptr in version_ptrs} for version_ptrs in ptrs]
        assert homes == [{0}, {1}, {0}], homes  # the pools stay the same objects throughout


@pytest.mark.timeout(60)
def test_a_refused_update_changes_nothing_and_ends_the_service() -> None:
    """An engine whose model is not the learner's (wider, so every shape differs) over real
    gloo: the update is refused before any tensor is loaded (the engine's weights and version
    are as before), the receiver takes no more updates and says why at once, the broadcaster
    evicts it (no ack), and the rollout worker's error for it names the config section."""
    from asyncrl.config import ConfigError
    from asyncrl.config.schema import TinyModelConfig
    from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model
    from asyncrl.weights.fit import WeightsRefused
    from rollouters.engines.torch_engine import TorchEngine
    from rollouters.worker import refused_weights

    torch.set_num_threads(1)
    engine = TorchEngine(build_tiny_model(TinyModelConfig(), len(VOCAB), 0), (EOS_ID,), PAD_ID)
    before = engine.state_dict()
    wider = build_tiny_model(TinyModelConfig(hidden_size=96), len(VOCAB), 1).state_dict()
    with engine_sync(engine, "engine-w", timeout_s=2.0) as (broadcaster, receiver):
        metrics = broadcaster.sync(wider, 1)
        assert metrics["weights/members"] == 0 and metrics["weights/evicted"] == 1, metrics
        started = time.monotonic()
        assert not receiver.wait_for_version(1, timeout=30.0)
        assert time.monotonic() - started < 1.0, "a refusal ends the wait at once"
        assert isinstance(receiver.refused, WeightsRefused)
        assert "shape" in str(receiver.refused), receiver.refused
        receiver._thread.join(5.0)
        assert not receiver._thread.is_alive(), "the receiver serves no more"
        assert engine.version == 0
        assert all(torch.equal(t, before[k]) for k, t in engine.state_dict().items())
        error = refused_weights(receiver.refused)
        assert isinstance(error, ConfigError) and str(error).startswith("model: ")
        assert str(receiver.refused) in str(error)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if sys.argv[1:2] == ["receiver"]:
        receiver_main(sys.argv[2], sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]),
                      int(sys.argv[6]))
