"""The seam of the weight sync: :func:`make_transport` knows the names, and each transport
moves one bucket from rank 0 to every other rank behind the same five methods."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from asyncrl.weights.rendezvous import dial_store, serve_store
from asyncrl.weights.transport import make_transport, transport_class


def test_the_package_and_the_factory_import_no_torch() -> None:
    """Roles import the transport modules lazily; the package, the factory and the core
    modules the weight sync moved into stay free of torch (``asyncrl --help`` stays fast)."""
    code = ("import sys, asyncrl.weights, asyncrl.weights.transport, asyncrl.control_plane, "
            "asyncrl.net, asyncrl.devices, asyncrl.evaluation, asyncrl.eval_checkpoint; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])


def test_the_factory_knows_gloo_and_sim_and_refuses_the_rest() -> None:
    assert transport_class("gloo").announced_opts(1000, 2.0) == {}
    assert transport_class("sim").announced_opts(1000, 2.0) == {"s_per_byte": 2.0 / 1000}
    with pytest.raises(NotImplementedError, match="'nccl'"):
        make_transport("nccl", host="127.0.0.1", timeout_s=1.0)


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
