"""``[rollout.vllm]``: its serving knobs reach vLLM's ``EngineArgs`` and ``SamplingParams``, and
a key vLLM does not know is a config error naming it (no engine is started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from rollouters.engines.vllm_options import VLLMOptions, engine_args, sampling_params


def test_a_typo_in_engine_args_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm",
                           "rollout.vllm.engine_args.max_num_batched_tokns=64"])
    assert "rollout.vllm.engine_args.max_num_batched_tokns" in str(info.value)
    cfg = load_config(None, ["rollout.engine=vllm",
                             "rollout.vllm.engine_args.max_num_batched_tokens=64"])
    assert cfg.rollout.vllm.engine_args == {"max_num_batched_tokens": 64}


def test_inprocess_mode_runs_one_worker() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=inprocess",
                           "rollout.vllm.tensor_parallel_size=2"])
    assert "rollout.vllm.mode" in str(info.value)


@pytest.mark.parametrize(("device", "eager"), [("cpu", True), ("cuda", False)])
def test_knobs_reach_engine_args(device: str, eager: bool, tiny_model_dir: Path) -> None:
    """enforce_eager unset follows the device; the serving knobs pass through as they are."""
    opts = VLLMOptions(eos_ids=(3,), device=device, tensor_parallel_size=2,
                       data_parallel_size=3, max_num_seqs=17, max_model_len=48,
                       gpu_memory_utilization=0.8, extra={"max_num_batched_tokens": 96})
    args = engine_args(tiny_model_dir, opts, asynchronous=True)
    assert (args.enforce_eager, args.tensor_parallel_size, args.data_parallel_size) == \
        (eager, 2, 3)
    assert (args.max_num_seqs, args.max_model_len, args.gpu_memory_utilization) == (17, 48, 0.8)
    assert args.max_num_batched_tokens == 96 and args.enable_prefix_caching
    assert args.logprobs_mode == "processed_logprobs"
    assert engine_args(tiny_model_dir, VLLMOptions(eos_ids=(3,), enforce_eager=False)) \
        .enforce_eager is False
    with pytest.raises(ValueError, match="rollout.vllm.engine_args.tensor_paralel_size"):
        engine_args(tiny_model_dir, VLLMOptions(eos_ids=(3,), extra={"tensor_paralel_size": 2}))


def test_sampling_knobs_reach_sampling_params() -> None:
    opts = VLLMOptions(eos_ids=(3, 7), top_p=0.9, top_k=20, stop=("</answer>",),
                       stop_token_ids=(11,))
    params = sampling_params(opts, n=4, temperature=0.7, max_new_tokens=9, delta=False)
    assert (params.n, params.temperature, params.max_tokens) == (4, 0.7, 9)
    assert (params.top_p, params.top_k, params.stop) == (0.9, 20, ["</answer>"])
    assert params.stop_token_ids == [3, 7, 11] and params.ignore_eos


def test_the_config_reaches_the_options_and_a_launched_servers_flags(tmp_path: Path) -> None:
    """``[rollout.vllm]`` → engine options (as make_engine builds them) → the api_server flags
    of a server a worker launches itself; ``weights.transport`` picks vLLM's backend name."""
    from rollouters.engines import _vllm_options
    from rollouters.engines.vllm_launch import serving_flags

    cfg = load_config(None, ["rollout.engine=vllm-server", "rollout.vllm.tensor_parallel_size=2",
                             "rollout.vllm.max_model_len=512", "rollout.vllm.top_p=0.9",
                             "rollout.vllm.engine_args.enable_chunked_prefill=false",
                             "rollout.vllm.engine_args.max_num_batched_tokens=96"])
    opts = _vllm_options(cfg, "cuda", seed=5, eos_ids=(3,))
    assert (opts.tensor_parallel_size, opts.max_model_len, opts.top_p) == (2, 512, 0.9)
    assert opts.weight_backend == "asyncrl_gloo" and opts.max_num_seqs == 256
    flags = serving_flags(opts)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--max-model-len"] == "512"
    assert pairs["--seed"] == "5" and "--kv-cache-memory-bytes" not in flags  # GPU: by fraction
    assert "--no-enable-chunked-prefill" in flags and "--enforce-eager" not in flags
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "96"


@pytest.mark.parametrize(("transport", "device"),
                         [("nccl", "cuda"), ("ipc", "cuda"), ("ipc", "cpu")])
def test_what_the_vllm_engines_cannot_send_is_refused_naming_the_key(
        transport: str, device: str, tiny_model_dir: Path) -> None:
    """In-process: only ``asyncrl_gloo`` (its worker shares this process's GPU, where NCCL
    refuses a second rank, and this process cannot open its own CUDA IPC handles: ``ipc`` and
    its CPU stand-in alike). AsyncLLM: ``asyncrl_nccl`` and ``ipc`` without CUDA refused by
    their senders before any engine starts. The config refuses the in-process ones, earlier."""
    from rollouters.engines import vllm_weight_backend
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_engine import VLLMEngine

    opts = VLLMOptions(eos_ids=(3,), weight_backend=vllm_weight_backend(transport, device))
    with pytest.raises(ValueError, match=f"weights.transport '{transport}'"):
        VLLMEngine(tiny_model_dir, opts)
    if device == "cuda" and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=f"weights.transport '{transport}' needs CUDA"):
            AsyncVLLMEngine(tiny_model_dir, opts)
    with pytest.raises(ConfigError, match=f"weights.transport = '{transport}'"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=inprocess",
                           f"weights.transport={transport}", "learner.device=cuda"])


def test_ipc_is_vllms_worker_half_on_a_gpu_and_its_shm_stand_in_on_cpu(
        tiny_model_dir: Path) -> None:
    """``weights.transport = "ipc"``: ``asyncrl_ipc`` (vLLM's ``ipc`` worker half, made safe)
    on CUDA, ``asyncrl_shm`` (the same over host shared memory) on CPU, one map deciding;
    ``auto`` stays ``asyncrl_gloo`` (rollouters.engines says why). The handles view one GPU:
    an engine of several workers is refused."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from rollouters.engines import _vllm_options, vllm_weight_backend
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_ipc import IpcSender
    from rollouters.engines.vllm_ipc_worker import IpcWeightTransfer, ShmWeightTransfer, register
    from rollouters.engines.vllm_launch import command
    from rollouters.engines.vllm_sender import GroupSender, make_sender

    assert (vllm_weight_backend("ipc", "cuda:1"), vllm_weight_backend("ipc", "cpu")) == \
        ("asyncrl_ipc", "asyncrl_shm")
    assert {vllm_weight_backend("auto", d) for d in ("cpu", "cuda:0")} == {"asyncrl_gloo"}
    cfg = load_config(None, ["rollout.engine=vllm", "weights.transport=ipc",
                             "learner.device=cuda"])
    assert _vllm_options(cfg, "cuda:0", seed=0, eos_ids=(3,)).weight_backend == "asyncrl_ipc"
    register()
    registry = WeightTransferEngineFactory._registry
    assert (registry["asyncrl_ipc"](), registry["asyncrl_shm"]()) == \
        (IpcWeightTransfer, ShmWeightTransfer)
    assert issubclass(ShmWeightTransfer, IpcWeightTransfer)
    assert issubclass(IpcWeightTransfer, IPCWeightTransferEngine)  # vLLM's own
    assert isinstance(make_sender("asyncrl_shm", "127.0.0.1", 1, 5.0), IpcSender)
    assert isinstance(make_sender("asyncrl_gloo", "127.0.0.1", 1, 5.0), GroupSender)
    with pytest.raises(ValueError, match="asyncrl_gloo .* not 'ipc'"):
        make_sender("ipc", "127.0.0.1", 1, 5.0)  # vLLM's name, not a backend we send with
    flags = command("/m", "127.0.0.1", 8000, "cuda", weight_backend="asyncrl_ipc")
    assert json.loads(flags[flags.index("--weight-transfer-config") + 1]) == \
        {"backend": "asyncrl_ipc"}
    with pytest.raises(ValueError, match="weights.transport 'ipc' needs one vLLM worker"):
        AsyncVLLMEngine(tiny_model_dir, VLLMOptions(eos_ids=(3,), weight_backend="asyncrl_shm",
                                                    tensor_parallel_size=2))
    with pytest.raises(ConfigError, match=r"weights.transport = 'ipc'.*needs one vLLM worker"):
        load_config(None, ["rollout.engine=vllm-server", "weights.transport=ipc",
                           "learner.device=cuda", "rollout.vllm.tensor_parallel_size=2"])


def test_the_cuda_handles_are_unpickled_with_torchs_globals_only() -> None:
    """What ``asyncrl_ipc``'s worker unpickles: a CUDA reduction's classes pass (its shape,
    built on CPU), anything else is refused before it runs, so no server needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``."""
    import os
    import pickle

    from rollouters.engines.vllm_ipc import pickled, unpickled_cuda_handles

    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.UntypedStorage, torch.bfloat16,
            0, b"handle", 12, 0, False, b"ref", 0, b"event", True)
    assert unpickled_cuda_handles(pickled([{"GPU-1": args}])) == [{"GPU-1": args}]
    with pytest.raises(pickle.UnpicklingError, match="refusing posix.system|refusing os.system"):
        unpickled_cuda_handles(pickled([{"GPU-1": (os.system, ("true",))}]))


def test_the_documented_command_takes_the_runs_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm_launch --weights-transport ipc`` starts the server an ``ipc`` run attaches to:
    ``asyncrl_ipc`` on a GPU, its stand-in on CPU."""
    from rollouters.engines import vllm_launch

    ran: list[list[str]] = []
    monkeypatch.setattr(vllm_launch.os, "execvpe", lambda _, argv, env: ran.append(argv))
    for device in ("cpu", "cuda"):
        vllm_launch.main(["/m", "--device", device, "--weights-transport", "ipc"])
    backends = [json.loads(argv[argv.index("--weight-transfer-config") + 1])["backend"]
                for argv in ran]
    assert backends == ["asyncrl_shm", "asyncrl_ipc"]


@pytest.mark.parametrize(("device", "enabled"), [("cpu", False), ("cuda", True)])
def test_sleep_mode_is_vllms_on_gpus_only(device: str, enabled: bool,
                                          tiny_model_dir: Path) -> None:
    """``launcher.colocate`` asks for vLLM's sleep mode where it frees memory; on CPU vLLM
    refuses the option (its sleep is a no-op there), so it is left unset: in-process, and as
    the flag of a server a worker launches (``vllm-server``)."""
    from rollouters.engines.vllm_launch import serving_flags
    from rollouters.engines.vllm_options import engine_kwargs

    opts = VLLMOptions(eos_ids=(3,), device=device, sleep_mode=True)
    assert engine_kwargs(tiny_model_dir, opts).get("enable_sleep_mode", False) is enabled
    assert ("--enable-sleep-mode" in serving_flags(opts)) is enabled
    off = VLLMOptions(eos_ids=(3,), device=device)
    assert "enable_sleep_mode" not in engine_kwargs(tiny_model_dir, off)
    assert "--enable-sleep-mode" not in serving_flags(off)


def test_cpu_tensor_parallelism_unbinds_threads_where_numa_nodes_are_too_few() -> None:
    """vLLM's ``auto`` binding wants a NUMA node per tensor-parallel worker and refuses to start
    without (test_vllm_tp.py started TP=2 here only unbound); a user's binding, one
    worker, a GPU, or nodes enough keep vLLM's own."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    from rollouters.engines.vllm_options import THREADS_BIND, cpu_thread_binding

    nodes = len(get_visible_memory_node())
    assert cpu_thread_binding("cpu", nodes + 1, {}) == {THREADS_BIND: "nobind"}
    assert cpu_thread_binding("cpu", nodes, {}) == {}
    assert cpu_thread_binding("cpu", nodes + 1, {THREADS_BIND: "0-3|4-7"}) == {}
    assert cpu_thread_binding("cuda", nodes + 1, {}) == {}
