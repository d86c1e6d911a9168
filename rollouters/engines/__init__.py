"""Inference engines behind one :class:`~rollouters.engines.base.Engine` protocol.

:func:`make_engine` is the only place that builds engines by their kind's name; the worker loop
and the workflows see just the protocol. What the rest of the code asks of a kind (does it need
``rollout.url``, run as threads, merge LoRA adapters itself) is in
:mod:`asyncrl.engine_kinds`. Engine modules are imported lazily: vLLM is an optional
dependency and slow to import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.tokens import ModelTokenizer
    from asyncrl.weights.receiver import WeightReceiver
    from buffers.protocol import ControlPlane
    from rollouters.engines.base import Engine


def make_engine(cfg: Config, model_dir: str | Path, index: int,
                tokens: ModelTokenizer) -> Engine:
    """The engine ``cfg.rollout.engine`` names, for rollout worker ``index``. ``tokens``: the
    worker's tokenizer of ``model_dir``, whose special ids the engine stops and pads with."""
    from asyncrl.devices import resolve_device

    kind = cfg.rollout.engine
    seed = cfg.run.seed * 1000 + index
    if kind == "sim":  # the tiny vocabulary's digits, no model
        from asyncrl.models import DIGIT_OFFSET, EOS_ID
        from rollouters.engines.sim import SimEngine

        return SimEngine(cfg.sim, eos_id=EOS_ID, token_ids=range(DIGIT_OFFSET, DIGIT_OFFSET + 10),
                         seed=seed)
    if kind == "sglang":
        return _sglang_engine(cfg, model_dir, index, seed, tokens.special.eos_ids)
    special = tokens.special  # the model's own EOS and pad ids
    if kind == "vllm-server":
        return _vllm_server_engine(cfg, model_dir, index, seed, special.eos_ids)
    device = str(resolve_device(cfg.rollout.device, index, "rollout.device"))
    if kind == "vllm":
        return _vllm_engine(cfg, model_dir, device, seed, special.eos_ids)
    if kind == "torch":
        from asyncrl.models import load_causal_lm
        from asyncrl.vlm import image_processor_for
        from rollouters.engines.torch_engine import TorchEngine

        return TorchEngine(load_causal_lm(model_dir, cfg.model.dtype, device),
                           eos_ids=special.eos_ids, pad_id=special.pad_id, device=device,
                           seed=seed, record_routing=cfg.learner.routing_replay,
                           image_processor=image_processor_for(model_dir))
    raise ValueError(f"unknown rollout.engine {kind!r}")


VLLM_WEIGHT_BACKENDS = {"gloo": "asyncrl_gloo", "auto": "asyncrl_gloo", "sim": "asyncrl_gloo",
                        "nccl": "asyncrl_nccl", "ipc": "asyncrl_ipc"}
"""vLLM's weight-transfer backend for each ``weights.transport`` on a GPU: our registered
backend (:mod:`rollouters.engines.vllm_gloo`: one class, ``asyncrl_gloo`` on CPU and GPU alike,
``asyncrl_nccl`` the same code over torch's NCCL with CUDA buckets), or ``asyncrl_ipc``:
vLLM's own ``ipc`` worker half with safe unpickling and a failed update finalized
(:mod:`rollouters.engines.vllm_ipc_worker`), fed CUDA IPC handles by our sender
(:mod:`rollouters.engines.vllm_ipc`).

``auto`` is ``asyncrl_gloo``, not ``ipc``, although a rollout worker always shares its own
engine's GPU: the backend is fixed when the engine starts (the learner's ``auto`` is chosen
per membership epoch, :func:`asyncrl.weights.transport.choose_transport`, and says nothing
about this hop), and ``asyncrl_ipc`` has not run on a GPU (no machine of ours runs vLLM on
one). Once it has, ``auto`` → ``asyncrl_ipc`` for an engine this worker starts on CUDA with
one worker is the change to make, here."""

CPU_STAND_INS = {"asyncrl_ipc": "asyncrl_shm"}
"""A backend that needs CUDA and what runs its code on a host, as ``asyncrl_gloo`` does
``asyncrl_nccl``'s: ``asyncrl_shm`` is ``asyncrl_ipc`` over host shared memory
(:mod:`rollouters.engines.vllm_ipc_worker`)."""


def vllm_weight_backend(transport: str, device: str) -> str:
    """vLLM's weight-transfer backend for ``weights.transport = transport``, the engine (and
    this worker) on ``device`` (``"cpu"`` or a CUDA device)."""
    backend = VLLM_WEIGHT_BACKENDS[transport]
    return CPU_STAND_INS.get(backend, backend) if device == "cpu" else backend


def _vllm_options(cfg: Config, device: str, seed: int, eos_ids: tuple[int, ...]) -> Any:
    """``[rollout.vllm]`` as the options both vLLM engine kinds take."""
    from rollouters.engines.vllm_options import DEFAULT_MAX_NUM_SEQS, VLLMOptions

    r, v = cfg.rollout, cfg.rollout.vllm
    return VLLMOptions(
        eos_ids=eos_ids, dtype=cfg.model.dtype, device="cpu" if device == "cpu" else "cuda",
        seed=seed, kv_cache_memory_mb=v.kv_cache_memory_mb,
        gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
        max_num_seqs=v.max_num_seqs or max(DEFAULT_MAX_NUM_SEQS, r.groups_per_batch * r.group_size),
        max_model_len=v.max_model_len, tensor_parallel_size=v.tensor_parallel_size,
        data_parallel_size=v.data_parallel_size, top_p=v.top_p, top_k=v.top_k,
        stop=tuple(v.stop), stop_token_ids=tuple(v.stop_token_ids),
        weight_backend=vllm_weight_backend(cfg.weights.transport, device),
        sleep_mode=cfg.launcher.colocate, freeze_vision=cfg.model.freeze_vision,
        routed_experts=cfg.learner.routing_replay, extra=dict(v.engine_args))


def _vllm_engine(cfg: Config, model_dir: str | Path, device: str, seed: int,
                 eos_ids: tuple[int, ...]) -> Engine:
    """``rollout.vllm.mode`` picks AsyncLLM or the in-process LLMEngine."""
    opts = _vllm_options(cfg, device, seed, eos_ids)
    if cfg.rollout.vllm.mode == "inprocess":
        from rollouters.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, opts, update_timeout_s=cfg.weights.timeout_s)
    from rollouters.engines.vllm_async import AsyncVLLMEngine

    return AsyncVLLMEngine(model_dir, opts, update_timeout_s=cfg.weights.timeout_s)


def _vllm_server_engine(cfg: Config, model_dir: str | Path, index: int, seed: int,
                        eos_ids: tuple[int, ...]) -> Engine:
    """Attach to ``rollout.url``'s server, or launch one with ``[rollout.vllm]``'s knobs on
    ``rollout.device`` (also this worker's: where an ``ipc`` update's handles are made)."""
    from asyncrl.devices import resolve_device
    from asyncrl.models import model_shapes
    from rollouters.engines.vllm_routing import RoutingLayout, refuse_on_cpu
    from rollouters.engines.vllm_server import VLLMServerEngine

    r = cfg.rollout
    device = str(resolve_device(r.device, index, "rollout.device"))
    opts = _vllm_options(cfg, device, seed, eos_ids)
    routing = RoutingLayout.of(model_dir) if opts.routed_experts else None
    if routing is not None and not r.url.strip():  # an attached server's device is its own
        refuse_on_cpu(device)
    sampling = {"top_p": opts.top_p, "top_k": opts.top_k, "stop": list(opts.stop),
                "stop_token_ids": list(opts.stop_token_ids)}
    shapes = model_shapes(model_dir)  # the learner's model, which an update must fit
    if r.url.strip():
        return VLLMServerEngine(_server_url(cfg, index), eos_ids=eos_ids,
                                timeout_s=r.request_timeout_s, sampling=sampling,
                                weight_backend=opts.weight_backend, routing=routing,
                                shapes=shapes)
    from rollouters.engines.vllm_fleet import VLLMServer
    from rollouters.engines.vllm_options import sleep_frees_memory

    server = VLLMServer(model_dir, opts, cfg.run_dir / f"vllm-{index}.log",
                        r.vllm.server_start_timeout_s)
    return VLLMServerEngine(server.url, eos_ids=eos_ids, timeout_s=r.request_timeout_s,
                            sampling=sampling, server=server,
                            sleep_frees=sleep_frees_memory(opts),
                            weight_backend=opts.weight_backend, routing=routing,
                            shapes=shapes)


def _server_url(cfg: Config, index: int) -> str:
    """Worker ``index``'s server in ``rollout.url``: one server per worker, because a server
    takes weights from one worker only."""
    urls = [u.strip() for u in cfg.rollout.url.split(",") if u.strip()]
    if cfg.rollout.workers > len(urls):
        raise ValueError(f"rollout.workers ({cfg.rollout.workers}) > servers in rollout.url "
                         f"({len(urls)}): a server takes weights from one worker only")
    return urls[index]


def _sglang_engine(cfg: Config, model_dir: str | Path, index: int, seed: int,
                   eos_ids: tuple[int, ...]) -> Engine:
    """Attach to ``rollout.url``'s server, or launch one (``rollout.sglang.module``)."""
    from asyncrl.models import model_shapes
    from rollouters.engines.sglang_engine import MEMORY_SAVER_FLAG, SglangEngine, SglangServer

    r = cfg.rollout
    timeouts = {"timeout_s": r.request_timeout_s, "generate_timeout_s": r.request_timeout_s,
                "update_timeout_s": 2 * cfg.weights.timeout_s,  # a join waits for the others
                "eos_ids": eos_ids, "pause_mode": r.sglang.pause_mode,
                "shapes": model_shapes(model_dir)}  # the learner's model, which updates fit
    if r.url.strip():
        return SglangEngine(_server_url(cfg, index), **timeouts)
    saver = [MEMORY_SAVER_FLAG] if cfg.launcher.colocate else []  # its sleep frees memory
    server = SglangServer(r.sglang.module, model_dir, cfg.model.dtype, seed,
                          [*r.sglang.args, *saver], cfg.run_dir / f"sglang-{index}.log",
                          r.sglang.server_start_timeout_s)
    return SglangEngine(server.url, server=server, **timeouts)


def make_weight_receiver(engine: Engine, control: ControlPlane, member: str,
                         host: str = "127.0.0.1") -> WeightReceiver:
    """The rollout side of the weight sync for ``engine``: an engine whose server receives
    the broadcast itself brings its own receiver (``weight_receiver``: SGLang's
    :class:`~rollouters.engines.sglang_engine.SglangWeightPeer`); every other engine receives
    through this process, adopting the received tensors where it can (``adopt_weights``),
    else copying them. ``host``: where this process's end of the broadcast binds
    (``weights.host``)."""
    from asyncrl.weights.receiver import WeightReceiver

    own = getattr(engine, "weight_receiver", None)
    if own is not None:
        return own(control, member)
    device = getattr(engine, "weights_device", None)  # buckets land there over nccl or ipc
    adopt = getattr(engine, "adopt_weights", None)
    if adopt is not None:  # zero-copy commit: the engine keeps the received tensors
        return WeightReceiver(control, member, adopt, host=host, adopt=True, device=device)
    return WeightReceiver(control, member,
                          lambda named, version: engine.load_weights(named.items(), version),
                          host=host, device=device)
