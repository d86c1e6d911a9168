"""``[rollout.vllm]``: its serving knobs reach vLLM's ``EngineArgs`` and ``SamplingParams``, and
a key vLLM does not know is a config error naming it (no engine is started here)."""

from __future__ import annotations

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


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_what_the_vllm_engines_cannot_send_is_refused_naming_the_key(
        transport: str, tiny_model_dir: Path) -> None:
    """In-process: only ``asyncrl_gloo`` (its worker shares this process's GPU, where NCCL
    refuses a second rank). AsyncLLM: ``ipc`` refused; ``asyncrl_nccl`` without CUDA refused
    by its sender before any engine starts. The config refuses the same, earlier."""
    from rollouters.engines import VLLM_WEIGHT_BACKENDS
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_engine import VLLMEngine

    opts = VLLMOptions(eos_ids=(3,), weight_backend=VLLM_WEIGHT_BACKENDS[transport])
    with pytest.raises(ValueError, match=f"weights.transport '{transport}'"):
        VLLMEngine(tiny_model_dir, opts)
    if transport == "ipc" or not torch.cuda.is_available():
        with pytest.raises((ValueError, RuntimeError), match=f"weights.transport '{transport}'"):
            AsyncVLLMEngine(tiny_model_dir, opts)
    with pytest.raises(ConfigError, match=f"weights.transport = '{transport}'"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=inprocess",
                           f"weights.transport={transport}", "learner.device=cuda"])


def test_nccl_is_the_gloo_backend_with_nccl_and_cuda_buckets() -> None:
    """``asyncrl_nccl`` is ``asyncrl_gloo``'s class and code: the registered name only picks
    the group's torch backend and the buckets' device (checked without CUDA: a plan, and the
    worker half built on a CUDA device it never touches here)."""
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollouters.engines import VLLM_WEIGHT_BACKENDS
    from rollouters.engines.vllm_gloo import (
        BACKEND,
        NCCL_BACKEND,
        GroupWeightTransfer,
        TransferPlan,
        check_devices,
        register,
        transfer_plan,
    )
    from rollouters.engines.vllm_sender import GroupSender

    register()
    registry = WeightTransferEngineFactory._registry
    assert registry[BACKEND]() is registry[NCCL_BACKEND]() is GroupWeightTransfer
    assert VLLM_WEIGHT_BACKENDS["nccl"] == NCCL_BACKEND
    assert VLLM_WEIGHT_BACKENDS["gloo"] == VLLM_WEIGHT_BACKENDS["auto"] == BACKEND
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert transfer_plan(BACKEND, gpu) == TransferPlan("gloo", cpu)
    assert transfer_plan(NCCL_BACKEND, gpu) == TransferPlan("nccl", gpu)
    assert transfer_plan(NCCL_BACKEND).device.type == "cuda"  # the sender's: its own GPU
    worker = GroupWeightTransfer(WeightTransferConfig(backend=NCCL_BACKEND), VllmConfig(),
                                 gpu, None)
    assert worker.plan == TransferPlan("nccl", gpu)
    with pytest.raises(ValueError, match="weights.transport"):
        transfer_plan("nccl")  # vLLM's own name, not ours
    check_devices(transfer_plan(BACKEND), "cpu", cpu)  # gloo: any two ends
    with pytest.raises(RuntimeError, match="weights.transport 'nccl'.*one device"):
        check_devices(transfer_plan(NCCL_BACKEND), "cpu", cpu)  # one device, two ranks
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="weights.transport 'nccl' needs CUDA"):
            GroupSender("127.0.0.1", 1, 5.0, NCCL_BACKEND)


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
