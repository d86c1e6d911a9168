"""The ``ipc`` weight transport: engines on the learner's GPU copy its packed buckets device to
device through CUDA IPC handles. The GPU tests run the receiving end in a child process (a
process cannot open its own IPC handle): ``python -m tests.unit.test_weight_ipc ...``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.weights.ipc import open_shared

ROOT = Path(__file__).resolve().parents[2]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TIMEOUT_S = 60.0


def test_a_handle_that_is_not_torchs_is_refused() -> None:
    """Handles come through the epoch's store: anything but torch's own reduction is refused
    before it can run."""
    with pytest.raises(pickle.UnpicklingError, match="refusing posix.system|refusing os.system"):
        open_shared(pickle.dumps((os.system, ("true",))))


def digest(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


def child(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "tests.unit.test_weight_ipc", *argv],
                            env=env, cwd=ROOT)


def transport_child(address: str, sizes: list[int]) -> None:
    """Rank 1 of an ipc group: receive each bucket, write its digest back."""
    from asyncrl.weights.rendezvous import dial_store
    from asyncrl.weights.transport import make_transport

    store = dial_store(address, TIMEOUT_S)
    end = make_transport("ipc", host="127.0.0.1", timeout_s=TIMEOUT_S)
    end.connect(store, "g", 1, 2)
    buffers = [torch.empty(n, dtype=torch.uint8, device=end.buffer_device()) for n in sizes]
    works = [end.receive(flat) for flat in buffers]
    for index, (work, flat) in enumerate(zip(works, buffers)):
        work.wait()
        store.set(f"digest/{index}", digest(flat))
    end.close()


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(120)
def test_ipc_moves_buckets_to_another_process_on_the_gpu() -> None:
    from asyncrl.weights.rendezvous import serve_store
    from asyncrl.weights.transport import make_transport

    store = serve_store("127.0.0.1", TIMEOUT_S)
    sizes = [3 * 2**20 + 5, 17, 2**20]
    proc = child(["transport", f"127.0.0.1:{store.port}", *map(str, sizes)])
    try:
        end = make_transport("ipc", host="127.0.0.1", timeout_s=TIMEOUT_S)
        end.connect(store, "g", 0, 2)
        source = torch.randint(0, 256, (sum(sizes) + 64,), dtype=torch.uint8, device="cuda")
        flats = [source[64 + sum(sizes[:i]):64 + sum(sizes[:i + 1])] for i in range(3)]
        for flat in flats:  # views at offsets inside one allocation, as staging slots are
            assert end.send(flat).wait(TIMEOUT_S)
        for index, flat in enumerate(flats):
            assert store.get(f"digest/{index}").decode() == digest(flat)
        end.close()
        assert proc.wait(TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def engine_child(address: str, out: str) -> None:
    """A rollout member on the GPU: receive updates with ``device=cuda`` and save them."""
    from safetensors.torch import save_file

    from asyncrl.weights.receiver import WeightReceiver
    from buffers.zmq_client import ZmqBufferClient

    beats, own = ZmqBufferClient(address, 10.0), ZmqBufferClient(address, 10.0)
    seen: list[str] = []

    def apply(named: dict[str, torch.Tensor], version: int) -> None:
        seen.append(str({t.device for t in named.values()}))
        save_file({k: v.cpu().clone() for k, v in named.items()}, f"{out}.v{version}.tmp")
        os.replace(f"{out}.v{version}.tmp", f"{out}.v{version}")

    receiver = WeightReceiver(own, "engine-gpu", apply, device=torch.device("cuda"))
    receiver.start()
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not receiver.wait_for_version(2, 0.5):
        beats.heartbeat("engine-gpu", "rollout", {"engine_version": receiver.last_version})
    beats.set_key("test/devices", {"seen": seen})
    receiver.stop()
    beats.close()
    own.close()


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("held", ["cuda", "cpu"])
def test_auto_moves_weights_by_ipc_to_an_engine_on_the_learners_gpu(tmp_path: Path,
                                                                    held: str) -> None:
    """The learner computes on the GPU; its gathered state is there, or in host memory
    (FSDP2 offloads it), whence the staging slots carry every bucket to the GPU."""
    from safetensors.torch import load_file

    from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster
    from asyncrl.weights.rendezvous import await_key
    from buffers.zmq_broker import start_broker_thread
    from buffers.zmq_client import ZmqBufferClient

    address, stop_broker = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0)),
                                               groups_per_step=1)
    control = ZmqBufferClient(address, 10.0)
    out = str(tmp_path / "engine")
    proc = child(["engine", address, out])
    broadcaster = WeightBroadcaster(control, WeightsConfig(bucket_mb=1, timeout_s=TIMEOUT_S),
                                    device=torch.device("cuda", 0))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not broadcaster.members() and time.monotonic() < deadline:
            control.get_key("test/none", 0, 0.5)  # a bounded wait for the child's heartbeat
        for version in (1, 2):
            torch.manual_seed(version)
            state = {"a": torch.randn(1024, 1024, device=held),  # 4 MB: a bucket of its own
                     "b": torch.randn(333, device=held).to(torch.bfloat16),
                     "c": torch.randn(64, 3, device=held)}
            metrics = broadcaster.sync(state, version)
            assert metrics["weights/members"] == 1, metrics
            assert broadcaster.transport == "ipc"
            got = load_file(f"{out}.v{version}")
            assert all(torch.equal(got[k], v.cpu()) for k, v in state.items())
        devices = await_key(control, "test/devices", lambda v: True, time.monotonic() + 30)
        assert devices is not None and all("cuda" in d for d in devices["seen"])
    finally:
        broadcaster.close()
        proc.wait(30)
        control.close()
        stop_broker()


if __name__ == "__main__":
    if sys.argv[1] == "transport":
        transport_child(sys.argv[2], [int(n) for n in sys.argv[3:]])
    else:
        engine_child(sys.argv[2], sys.argv[3])
