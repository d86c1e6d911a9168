"""What both vLLM engine modes share: their options, ``EngineArgs``, sampling parameters, and
per-token versions read from vLLM's ``weight_versions`` spans.

The engines (:mod:`vllm_engine`: ``LLMEngine`` stepped in this process; :mod:`vllm_async`:
``AsyncLLM`` with its engine core in its own process) differ only in how they drive vLLM. The
arguments vLLM gets, and how its outputs become :class:`~rollouters.engines.base.Completion`
rows, are here once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.vlm import VisionSpec, is_vision_name, vision_spec
from rollouters.engines.base import Completion
from rollouters.engines.vllm_routing import OPTION as ROUTED_EXPERTS_OPTION
from rollouters.engines.vllm_routing import RoutingLayout, to_routing
from rollouters.engines.vllm_sleep import releases_memory

logger = logging.getLogger(__name__)

# Smallest attention head size vLLM's CPU attention kernels support (the text model's; the
# vision tower runs torch SDPA, any head size).
CPU_MIN_HEAD_DIM = 32
MAX_IMAGES_PER_PROMPT = 8  # vLLM sizes its encoder budget by it; rollout.vllm.engine_args
# (limit_mm_per_prompt) overrides it
DEFAULT_MAX_NUM_SEQS = 256
CPU_KV_CACHE_MB = 64  # a KV cache in bytes on CPU: a GPU fraction means nothing on a shared host
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU workers' OpenMP binding ("auto")


@dataclass
class VLLMOptions:
    """What an engine needs beyond the model directory (mapped from ``[rollout.vllm]``).

    ``enforce_eager`` None follows the device: eager on CPU (vLLM's CPU backend has no CUDA
    graphs), CUDA graphs on GPU (vLLM's default, the fast decode). ``kv_cache_memory_mb`` None
    follows it too: 64 MB on CPU, ``gpu_memory_utilization`` on GPU. ``weight_backend`` is the
    name vLLM's weight-transfer factory knows (our gloo backend on CPU). ``sleep_mode``: the
    engine will sleep (``launcher.colocate``): vLLM's ``enable_sleep_mode`` on GPUs; on CPU
    vLLM refuses it and its sleep is a no-op (:mod:`vllm_sleep`)."""

    eos_ids: tuple[int, ...]  # any of them ends a row (asyncrl.tokens)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    kv_cache_memory_mb: int | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    weight_backend: str = "asyncrl_gloo"
    sleep_mode: bool = False
    freeze_vision: bool = True
    """A VLM's vision tower is frozen (``model.freeze_vision``): updates leave its weights
    out, whatever the sender sends (:func:`sent_weights`)."""
    routed_experts: bool = False
    """Return each position's experts (``learner.routing_replay``; GPUs only:
    :mod:`vllm_routing`)."""
    extra: dict[str, Any] = field(default_factory=dict)


def configure_process_env(device: str, in_process: bool, tensor_parallel_size: int = 1
                          ) -> None:
    """Environment vLLM reads at engine start; must run before the engine is built.

    In-process mode needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (it steps the core itself). The
    others are CPU defaults a caller may override (the notes: without them a shared 2-core
    machine compiles for seconds and runs 20x slower), and the thread binding that lets
    tensor parallelism start on CPU (:func:`cpu_thread_binding`)."""
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(cpu_thread_binding(device, tensor_parallel_size, os.environ))


def cpu_thread_binding(device: str, tensor_parallel_size: int, env: Mapping[str, str]
                       ) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND=nobind`` where vLLM's default binding would refuse to start.

    On CPU, vLLM's ``auto`` binding pins each tensor-parallel worker of an engine core to a
    NUMA node of its own and fails the engine's start ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers", ``vllm/utils/ompmultiprocessing.py``) on a host with fewer
    nodes than workers: any single-socket machine, CI's included. Unbound, the workers run
    with ``OMP_NUM_THREADS`` threads each. A binding the user set is kept, as is ``auto``
    wherever there are nodes enough (data-parallel replicas are engine cores of one worker
    each: they always fit)."""
    if device != "cpu" or tensor_parallel_size <= 1 or THREADS_BIND in env:
        return {}
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    nodes = len(get_visible_memory_node())
    if nodes >= tensor_parallel_size:
        return {}
    logger.info("vLLM on CPU: %d NUMA node(s) for %d tensor-parallel workers, so %s=nobind",
                nodes, tensor_parallel_size, THREADS_BIND)
    return {THREADS_BIND: "nobind"}


def engine_arg_names() -> set[str]:
    """The fields of vLLM's ``EngineArgs``: what ``rollout.vllm.engine_args`` may set."""
    from vllm import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_extra_args(extra: dict[str, Any]) -> None:
    """A key ``EngineArgs`` does not have is a config error naming it (the schema checks this
    too where vLLM is installed beside the config; this is the engine's own guard)."""
    unknown = sorted(set(extra) - engine_arg_names())
    if unknown:
        raise ValueError(f"rollout.vllm.engine_args.{unknown[0]}: not a vLLM EngineArgs field")


def engine_kwargs(model_dir: str | Path, opts: VLLMOptions) -> dict[str, Any]:
    """The ``EngineArgs`` keywords for one rollout engine (token ids in and out).

    Prefix caching is on: each weight update resets it (a prefix cached under old weights is
    never reused). The tokenizer is loaded only when stop strings need detokenized text."""
    check_extra_args(opts.extra)
    kwargs: dict[str, Any] = {
        "model": str(model_dir), "dtype": opts.dtype, "seed": opts.seed,
        "enforce_eager": (opts.device == "cpu") if opts.enforce_eager is None
        else opts.enforce_eager,
        "skip_tokenizer_init": not opts.stop,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True,
        "max_num_seqs": opts.max_num_seqs, "worker_extension_cls": _extension_cls(),
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "data_parallel_size": opts.data_parallel_size,
        "weight_transfer_config": {"backend": opts.weight_backend}}
    if sleep_frees_memory(opts):
        kwargs["enable_sleep_mode"] = True
    if opts.routed_experts:
        kwargs[ROUTED_EXPERTS_OPTION] = True
    if opts.max_model_len is not None:
        kwargs["max_model_len"] = opts.max_model_len
    if vision_spec(model_dir) is not None:
        # vLLM's multimodal processor needs the tokenizer (it refuses skip_tokenizer_init);
        # images only (videos would need torchvision on CPU: vllm_qwen2_vl).
        kwargs["skip_tokenizer_init"] = False
        kwargs["limit_mm_per_prompt"] = {"image": MAX_IMAGES_PER_PROMPT, "video": 0}
        from rollouters.engines import vllm_qwen2_vl

        if vllm_qwen2_vl.needed():  # its stand-ins reach every vLLM process with the config
            kwargs["hf_overrides"] = vllm_qwen2_vl.keep_config
    kv_mb = kv_cache_mb(opts)
    if kv_mb:
        kwargs["kv_cache_memory_bytes"] = kv_mb << 20
    kwargs.update(opts.extra)
    return kwargs


def sleep_frees_memory(opts: VLLMOptions) -> bool:
    """vLLM's sleep mode is on, so its sleep frees device memory: a sleeping engine on a GPU."""
    return opts.sleep_mode and releases_memory(opts.device)


def kv_cache_mb(opts: VLLMOptions) -> int:
    """The KV cache's size in MB; 0: sized from ``gpu_memory_utilization``."""
    if opts.kv_cache_memory_mb is not None:
        return opts.kv_cache_memory_mb
    return CPU_KV_CACHE_MB if opts.device == "cpu" else 0


def _extension_cls() -> str:
    from rollouters.engines.vllm_extension import EXTENSION_CLS

    return EXTENSION_CLS


def engine_args(model_dir: str | Path, opts: VLLMOptions, asynchronous: bool = False) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    return (AsyncEngineArgs if asynchronous else EngineArgs)(**engine_kwargs(model_dir, opts))


def sampling_params(opts: VLLMOptions, n: int, temperature: float, max_new_tokens: int,
                    delta: bool) -> Any:
    """Sampling as the learner recomputes it: logprobs after temperature (and top-k/top-p),
    stopping at the model's EOS ids and ``stop_token_ids``, never at vLLM's own idea of EOS."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens,
                          top_p=opts.top_p, top_k=opts.top_k, stop=list(opts.stop) or None,
                          logprobs=0, stop_token_ids=[*opts.eos_ids, *opts.stop_token_ids],
                          ignore_eos=True, detokenize=bool(opts.stop), output_kind=kind)


def check_head_dim(model_dir: str | Path, device: str) -> None:
    """Fail early and clearly where vLLM's CPU kernels would fail at the first batch."""
    if device != "cpu":
        return
    from transformers import AutoConfig

    from asyncrl.models import attention_head_dim

    head_dim = attention_head_dim(AutoConfig.from_pretrained(str(model_dir)))
    if head_dim < CPU_MIN_HEAD_DIM:
        raise ValueError(
            f"vLLM on CPU needs an attention head size >= {CPU_MIN_HEAD_DIM}, the model has "
            f"{head_dim}: for the tiny model use model.tiny.hidden_size / num_heads >= 32 "
            "(e.g. --set model.tiny.num_heads=2 --set model.tiny.num_kv_heads=1)")


def parse_version(label: str | None, default: int) -> int:
    """Version labels are our integers as strings; vLLM's initial label is "default"."""
    try:
        return int(label) if label is not None else default
    except ValueError:
        return default


def span_versions(spans: list[Any] | None, length: int, default: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``[start, end)`` per label,
    objects or dicts): each token carries the label the engine core held when it sampled it."""
    if length and not spans:
        raise RuntimeError("vLLM returned no weight_versions for a completion (vLLM too old?)")
    versions = [default] * length
    for span in spans or ():
        get = span.get if isinstance(span, dict) else lambda key, s=span: getattr(s, key)
        start, end = get("start"), get("end")
        versions[start:end] = [parse_version(get("version"), default)] * (end - start)
    return versions


def completion(sample: Any, default_version: int, prompt_length: int = 0,
               routing: RoutingLayout | None = None) -> Completion:
    """One finished vLLM ``CompletionOutput`` as a row: logprobs of the sampled tokens (vLLM
    always includes them with ``logprobs=0``), versions from its spans. A stop string ends a
    row as an EOS does. ``routing``: the model's layout, when vLLM returns routed experts
    (their rows cover the prompt, of ``prompt_length`` tokens, then the completion)."""
    tokens = list(sample.token_ids)
    logprobs = [step[token].logprob for token, step in zip(tokens, sample.logprobs)]
    return Completion(tokens=tokens, logprobs=logprobs,
                      versions=span_versions(sample.weight_versions, len(tokens),
                                             default_version),
                      finish_reason="stop" if sample.finish_reason == "stop" else "length",
                      routing=None if routing is None else
                      to_routing(sample.routed_experts, prompt_length, len(tokens), routing))


def prepare_vlm(model_dir: str | Path) -> VisionSpec | None:
    """The model's :class:`VisionSpec` (None: text-only); for a VLM, vLLM's Qwen2-VL is made
    to work without torchvision first, where that is missing (:mod:`vllm_qwen2_vl`)."""
    spec = vision_spec(model_dir)
    if spec is not None:
        from rollouters.engines.vllm_qwen2_vl import register

        register()
    return spec


def vllm_prompts(prompts: list[list[int]], images: list[list[bytes]] | None,
                 spec: VisionSpec | None) -> list[dict[str, Any]]:
    """Each prompt as vLLM takes it, with its images (:func:`vllm_prompt`)."""
    return [vllm_prompt(p, images[i] if images else None, spec) for i, p in enumerate(prompts)]


def vllm_prompt(prompt: list[int], images: list[bytes] | None, spec: VisionSpec | None
                ) -> dict[str, Any]:
    """One prompt as vLLM takes it. With images: their PIL images as ``multi_modal_data`` and
    the ids with each image's pads collapsed to one, because vLLM's multimodal processor
    always expands each image's first pad to ``grid_t·grid_h·grid_w / merge_size²`` pads
    itself (``PromptReplacement`` in vLLM's ``qwen2_vl.py``): from our already expanded ids
    it would add pads. The ids vLLM runs are then ours again, which tests check."""
    if not images:
        return {"prompt_token_ids": list(prompt)}
    from asyncrl.vlm import decode_images

    if spec is None:
        raise ValueError("images were given to a vLLM engine serving a text-only model")
    return {"prompt_token_ids": collapse_image_tokens(prompt, spec),
            "multi_modal_data": {"image": decode_images(images)}}


def collapse_image_tokens(ids: list[int], spec: VisionSpec) -> list[int]:
    """``ids`` with each image's pads (the run right after a ``<|vision_start|>``) as one pad:
    the inverse of :func:`asyncrl.vlm.expand_image_tokens`. A pad anywhere else (a policy may
    sample one, and a later turn's prompt then holds it) stays as it is."""
    out: list[int] = []
    in_image = False
    for token in ids:
        if token == spec.image_token_id and in_image and out[-1] == token:
            continue
        in_image = token == spec.vision_start_id or (in_image and token == spec.image_token_id)
        out.append(token)
    return out


def sent_weights(tensors: list[tuple[str, Any]], opts: VLLMOptions) -> list[tuple[str, Any]]:
    """The tensors an update sends to vLLM: all of them, less a frozen vision tower's
    (``model.freeze_vision``: the engine's tower never changes, so it is never sent)."""
    if not opts.freeze_vision:
        return tensors
    return [(name, t) for name, t in tensors if not is_vision_name(name)]


def moves_vision(tensors: list[tuple[str, Any]]) -> bool:
    """Does this update change the vision tower? Then vLLM's encoder cache (each image's
    embeddings, kept by image hash across requests) is stale and must be reset with it: a
    prefix-cache reset leaves it, and an image seen before the update would be served the old
    tower's embeddings (tests/engines/test_vllm_vlm.py caught exactly that)."""
    return any(is_vision_name(name) for name, _ in tensors)
