"""The seam of the weight sync: :func:`make_transport` knows the names, and each transport
moves one bucket from rank 0 to every other rank behind the same five methods; ``auto`` picks
one from the devices, and a transport that needs CUDA is refused without it, naming the key."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.preflight import transport_errors
from asyncrl.weights.rendezvous import dial_store, serve_store
from asyncrl.weights.transport import (
    announced_opts,
    choose_transport,
    describe_device,
    make_transport,
    transport_class,
)
from asyncrl.weights.watchdog import Watchdog


def test_the_package_and_the_factory_import_no_torch() -> None:
    """Roles import the transport modules lazily; the package, the factory and the core
    modules the weight sync moved into stay free of torch (``asyncrl --help`` stays fast)."""
    code = ("import sys, asyncrl.weights, asyncrl.weights.transport, asyncrl.control_plane, "
            "asyncrl.net, asyncrl.devices, asyncrl.evaluation, asyncrl.eval_checkpoint; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])


def test_the_factory_knows_every_transport_and_refuses_the_rest() -> None:
    assert transport_class("gloo").announced_opts(1000, 2.0) == {}
    assert transport_class("nccl").announced_opts(1000, 2.0) == {}
    assert transport_class("ipc").announced_opts(1000, 2.0) == {}
    assert transport_class("sim").announced_opts(1000, 2.0) == {"s_per_byte": 2.0 / 1000}
    assert announced_opts("auto", 1000, 2.0) == {}
    with pytest.raises(NotImplementedError, match="'shm'"):
        make_transport("shm", host="127.0.0.1", timeout_s=1.0)


def test_nccl_is_the_gloo_path_with_another_backend() -> None:
    """NCCL between two processes needs two GPUs, which these machines never have: what CI
    runs through gloo must be all of NCCL's path but the backend object and the device."""
    from asyncrl.weights.group import GlooTransport, GroupTransport, NcclTransport

    def own(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("__")}

    assert own(GlooTransport) == {"_backend"}
    assert own(NcclTransport) == {"DEVICE_PREFIX", "_backend", "_buffer_device"}
    assert {"connect", "send", "receive", "close", "buffer_device"} <= own(GroupTransport)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("name", ["nccl", "ipc"])
def test_a_cuda_transport_without_cuda_is_refused_naming_the_key(name: str) -> None:
    """At start-up (``asyncrl up`` and ``--dry-run``), and by the end itself if a role gets
    that far on a machine without CUDA."""
    cfg = load_config(None, [f"weights.transport={name}", "learner.device=cuda"])
    assert transport_errors(cfg) == [
        f"weights.transport: {name!r} needs CUDA, but this machine sees no CUDA device "
        f"(torch {torch.__version__}); use 'auto' or 'gloo'"]
    with pytest.raises(RuntimeError, match=f"weights.transport '{name}' needs CUDA"):
        make_transport(name, host="127.0.0.1", timeout_s=1.0)


@pytest.mark.parametrize("name", ["auto", "gloo", "sim"])
def test_the_cpu_transports_pass_the_start_up_check(name: str) -> None:
    assert transport_errors(load_config(None, [f"weights.transport={name}"])) == []


@pytest.mark.parametrize("name", ["nccl", "ipc"])
def test_a_cuda_transport_with_a_cpu_learner_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match=f"weights.transport \\('{name}'\\) moves CUDA "
                                          "buckets, but learner.device is 'cpu'"):
        load_config(None, [f"weights.transport={name}", "learner.device=cpu"])


GPU_A, GPU_B = "cuda:GPU-a", "cuda:GPU-b"


@pytest.mark.parametrize(("learner", "members", "chosen"), [
    ("cpu", ["cpu", "cpu"], "gloo"),  # CPU
    (GPU_A, ["cpu"], "gloo"),  # a CPU engine: only gloo reaches it
    ("cpu", [GPU_A], "gloo"),
    (GPU_A, [GPU_A, GPU_A], "ipc"),  # colocated: the learner's GPU
    (GPU_A, [GPU_B, "cuda:GPU-c"], "nccl"),  # every engine on a GPU of its own
    (GPU_A, [GPU_A, GPU_B], "gloo"),  # mixed: NCCL refuses two ranks on GPU a, ipc misses b
    (GPU_A, [], "gloo"),
])
def test_auto_picks_the_transport_from_the_devices(learner: str, members: list[str],
                                                   chosen: str) -> None:
    assert choose_transport("auto", learner, members) == chosen


def test_a_named_transport_is_kept_whatever_the_devices() -> None:
    assert choose_transport("gloo", GPU_A, [GPU_A]) == "gloo"
    assert choose_transport("sim", "cpu", ["cpu"]) == "sim"


def test_a_device_is_described_by_the_gpu_it_is_on() -> None:
    assert describe_device(None) == describe_device(torch.device("cpu")) == "cpu"


def test_the_watchdog_aborts_once_and_fails_every_pending_collective() -> None:
    """A collective that never finishes (NCCL does not raise) is given up at the timeout:
    the group is aborted once and every wait on it fails at once, naming the setting."""
    aborted = threading.Event()
    calls = []
    dog = Watchdog(0.2, lambda: (calls.append(1), aborted.set()), "g")
    finished, stuck = dog.watch(), dog.watch()
    finished.settled.set()
    dog.poke()
    assert aborted.wait(10)
    assert stuck.settled.wait(10)
    assert stuck.expired is not None and "weights.timeout_s" in stuck.expired
    assert finished.expired is None and calls == [1]
    late = dog.watch()  # the group is gone: a new collective on it fails at once
    assert late.settled.is_set() and late.expired is not None


def test_the_watchdog_counts_from_the_last_progress_not_from_the_post() -> None:
    """A receiver posts every bucket of an update at once: a bucket still pending past
    ``timeout_s`` after its post is fine while the ones before it keep finishing."""
    aborted = threading.Event()
    dog = Watchdog(1.5, aborted.set, "g")
    first, second = dog.watch(), dog.watch()
    assert not first.settled.wait(0.9)
    first.settled.set()
    dog.poke()  # progress at ~0.9 s: the second is now due at ~2.4 s, not 1.5 s
    assert not second.settled.wait(0.9) and not aborted.is_set()
    assert second.settled.wait(10) and second.expired is not None and aborted.is_set()


def test_a_watchdog_closed_in_time_aborts_nothing() -> None:
    calls = []
    dog = Watchdog(60.0, lambda: calls.append(1), "g")
    item = dog.watch()
    dog.close()
    assert not item.settled.wait(0.05) and calls == []


@pytest.mark.timeout(60)
def test_a_gloo_bucket_nobody_receives_fails_within_the_timeout() -> None:
    """Rank 1 joins the group but never posts its receive (a frozen engine): rank 0's send
    must fail within about ``timeout_s``, not hang; the same path bounds NCCL."""
    store = serve_store("127.0.0.1", 30.0)
    address = f"127.0.0.1:{store.port}"
    ends = [make_transport("gloo", host="127.0.0.1", timeout_s=1.5) for _ in range(2)]
    joined = threading.Barrier(2)

    def frozen() -> None:
        ends[1].connect(dial_store(address, 30.0), "g", 1, 2)
        joined.wait()

    thread = threading.Thread(target=frozen)
    thread.start()
    ends[0].connect(store, "g", 0, 2)
    joined.wait()
    work = ends[0].send(torch.ones(64 * 2**20, dtype=torch.uint8))
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        work.wait()
    assert time.monotonic() - start < 10
    thread.join(10)
    for end in ends:
        end.close()


@pytest.mark.parametrize("name", ["gloo", "sim"])
def test_an_end_never_connected_closes_twice_and_buffers_on_cpu(name: str) -> None:
    opts = transport_class(name).announced_opts(1, 0.0)
    end = make_transport(name, host="127.0.0.1", timeout_s=1.0, **opts)
    assert end.buffer_device() == torch.device("cpu")
    end.close()
    end.close()


@pytest.mark.timeout(60)
def test_gloo_delivers_a_bucket_to_every_rank_over_the_epochs_store() -> None:
    """Three ends in three threads (one group needs every rank at once): rank 0 serves the
    store and sends, the others dial it and receive into buffers of the bucket's size."""
    store = serve_store("127.0.0.1", 30.0)
    address = f"127.0.0.1:{store.port}"
    ends = [make_transport("gloo", host="127.0.0.1", timeout_s=30.0) for _ in range(3)]
    sent = torch.arange(200, dtype=torch.uint8)
    received = [torch.zeros(200, dtype=torch.uint8) for _ in range(3)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            ends[rank].connect(store if rank == 0 else dial_store(address, 30.0), "g", rank, 3)
            work = ends[0].send(sent) if rank == 0 else ends[rank].receive(received[rank])
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    for end in ends:
        end.close()
    assert not errors, errors
    assert torch.equal(received[1], sent) and torch.equal(received[2], sent)
