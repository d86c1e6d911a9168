"""What the rest of the code needs to know about each inference engine kind (``rollout.engine``).

:func:`rollouters.engines.make_engine` builds engines; the config, the launchers, the learner
and the weight sync only ask questions about a kind: does it need ``rollout.url``, do its
workers run as threads, does it merge LoRA adapters itself, how must the weight buckets be cut
for it. Each kind answers them here, as one :class:`EngineKind`, so none of that code tests an
engine's name. The facts live in the core package because ``learners`` and ``asyncrl.weights``
need some of them and may not import ``rollouters``. Pure data: no engine module is imported.

To add an engine kind: its module and a branch in ``make_engine``, its name in
``rollout.engine``'s choices, and one :class:`EngineKind` in :data:`ENGINE_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ENGINE_KINDS", "EngineKind", "engine_kind"]


@dataclass(frozen=True)
class EngineKind:
    """One value of ``rollout.engine`` and what the code around the engine must know of it.

    The weight facts (``packs_every_tensor``, ``bucket_align``) follow from an engine that
    receives the broadcast in its own server (SGLang's ``SglangWeightPeer``), which the engine
    object itself says (:func:`rollouters.engines.make_weight_receiver`).
    """

    name: str
    table: str | None = None
    """The sub-table of ``[rollout]`` with this kind's own keys (``[rollout.vllm]``); None: it
    reads none. :mod:`asyncrl.config.resolve` warns about the others, which nothing reads."""
    needs_url: bool = False
    """Attaches to servers at ``rollout.url`` and starts none, so the URL is required."""
    threads: bool = False
    """Its workers run as threads of a few processes: a simulated engine only waits."""
    merges_adapters: bool = False
    """With ``model.lora`` it is sent the LoRA adapters and merges them itself; every other
    kind is sent the merged weights."""
    packs_every_tensor: bool = False
    """Every tensor goes into a bucket (``weights.alone_mb = 0``): its server takes one
    blocking HTTP request per bucket while paused, so few large requests beat one per tensor."""
    bucket_align: int | None = None
    """The alignment of tensors inside a bucket it can receive; None: the bucket plan's default
    (:data:`asyncrl.weights.plan.ALIGN`). SGLang's flattened buckets carry no padding: 1."""
    sleeps: bool = False
    """Can free its device memory between generation phases and take it back
    (``sleep``/``wake_up``, :class:`~rollouters.engines.base.Sleeper`): what
    ``launcher.colocate`` needs of it. ``vllm`` and ``vllm-server``: vLLM's sleep mode, whose
    memory release is GPU-only (on CPU the same calls run, and free nothing:
    ``rollouters.engines.vllm_sleep``); ``sglang``: SGLang's memory saver
    (``--enable-memory-saver``), in the same order."""
    records_routing: bool = False
    """It can return the experts each token was routed to (``learner.routing_replay``)."""
    routing_note: str = "does not record the experts it routes each token to"
    """Why not, for the config error, where it does not."""
    routing_refusal: Callable[[Any], str | None] | None = None
    """Why this kind cannot record them with the config's other keys (the config error), or
    None: a kind that records routing on some devices only."""
    takes_images: bool = False
    """Its ``generate`` takes prompts' images (``images=``, a vision-language model:
    :mod:`asyncrl.vlm`)."""
    transport_refusal: Callable[[Any], str | None] | None = None
    """Why this kind cannot take the config's ``weights.transport`` (the config error), or
    None; given the whole config, since the reason may hang on the kind's own keys."""


def _vllm_routing_refusal(cfg: Any) -> str | None:
    """vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from its Model
    Runner V2, which needs Triton: its CPU install refuses the option
    (:mod:`rollouters.engines.vllm_routing`). ``rollout.device = "auto"`` is decided where the
    engine starts; an attached server (``rollout.url``) runs on its own device."""
    attached = cfg.rollout.engine == "vllm-server" and cfg.rollout.url.strip()
    if cfg.rollout.device != "cpu" or attached:
        return None
    return (f"learner.routing_replay = true with rollout.engine = {cfg.rollout.engine!r} and "
            "rollout.device = 'cpu': vLLM 0.32 returns routed experts only from its Model "
            "Runner V2, which needs Triton, and its CPU install refuses them (use "
            "rollout.device = 'cuda', or rollout.engine = 'torch' on CPU)")


def _vllm_transport_refusal(cfg: Any) -> str | None:
    """What the vLLM engines' transfer backends cannot do (:mod:`rollouters.engines.vllm_gloo`,
    :mod:`rollouters.engines.vllm_ipc`): ``ipc`` in-process would have this process open its
    own CUDA IPC handles, which CUDA refuses, and its handles view this process's one GPU, so
    only an engine of one worker can map them; ``nccl`` in-process would put the sender and
    vLLM's worker on one GPU, which NCCL refuses."""
    engine, transport, v = cfg.rollout.engine, cfg.weights.transport, cfg.rollout.vllm
    inprocess = engine == "vllm" and v.mode == "inprocess"
    if transport == "ipc" and inprocess:
        return ("weights.transport = 'ipc' with rollout.vllm.mode = 'inprocess': vLLM's "
                "worker would run in this process, which cannot open its own CUDA IPC handles "
                "(use rollout.vllm.mode = 'async', or weights.transport = 'gloo' or 'auto')")
    if transport == "ipc" and v.tensor_parallel_size * v.data_parallel_size != 1:
        return (f"weights.transport = 'ipc' with rollout.engine = {engine!r} needs one vLLM "
                "worker (rollout.vllm.tensor_parallel_size × data_parallel_size = 1): the "
                "handles view the rollout worker's one GPU (use 'nccl', 'gloo' or 'auto')")
    if inprocess and transport == "nccl":
        return ("weights.transport = 'nccl' with rollout.vllm.mode = 'inprocess': the worker "
                "shares this process's GPU, and NCCL refuses two ranks on one device (use "
                "rollout.vllm.mode = 'async', or weights.transport = 'gloo' or 'auto')")
    return None


ENGINE_KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (
    EngineKind("torch", merges_adapters=True, sleeps=True, records_routing=True,
               takes_images=True),
    EngineKind("vllm", table="vllm", sleeps=True, takes_images=True, records_routing=True,
               routing_refusal=_vllm_routing_refusal, transport_refusal=_vllm_transport_refusal),
    EngineKind("vllm-server", table="vllm", sleeps=True, records_routing=True,
               routing_refusal=_vllm_routing_refusal, transport_refusal=_vllm_transport_refusal),
    EngineKind("sglang", table="sglang", packs_every_tensor=True, bucket_align=1, sleeps=True),
    EngineKind("sim", threads=True),
)}
"""Every engine kind by its ``rollout.engine`` name (the schema's choices, in its order)."""


def engine_kind(name: str) -> EngineKind:
    """The kind ``rollout.engine = name`` selects; ``ValueError`` naming the choices for an
    unknown one."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown rollout.engine {name!r} "
                         f"({', '.join(ENGINE_KINDS)})") from None
