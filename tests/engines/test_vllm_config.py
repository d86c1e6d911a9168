"""``[rollout.vllm]``: its serving knobs reach vLLM's ``EngineArgs`` and ``SamplingParams``, and
a key vLLM does not know is a config error naming it (no engine is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_vllm_backends_without_a_sender_are_refused_naming_the_key(
        backend: str, tiny_model_dir: Path) -> None:
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_engine import VLLMEngine

    for engine in (VLLMEngine, AsyncVLLMEngine):
        with pytest.raises(ValueError, match="weights.transport"):
            engine(tiny_model_dir, VLLMOptions(eos_ids=(3,), weight_backend=backend))


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
