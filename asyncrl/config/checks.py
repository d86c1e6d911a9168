"""Rules that tie keys of different sections together, checked on the whole :class:`Config`.

Each check returns its problems as lines that start with every key involved and its value, so
``asyncrl`` reports them with the others, all at once. They only reject: nothing here rewrites
a section (STYLE.md, habit 6). Rules within one section live on that section's model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from asyncrl.config.limits import WEEK_S
from asyncrl.config.resolve import selected_table
from asyncrl.engine_kinds import ENGINE_KINDS, engine_kind

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

PROMPT_EXTRA_TOKENS = 2
"""A digit prompt is BOS, the digits, SEP: ``task.length + 2`` positions."""
PROMETHEUS_OFFSETS = 2
"""The buffer serves ``monitor.prometheus_port + 0``, the learner ``+ 1``, rollout worker i
``+ 2 + i`` (:mod:`asyncrl.prometheus`)."""


def consistency_problems(cfg: Config) -> list[str]:
    """Every cross-section problem of ``cfg``, one line each (empty: none)."""
    return [problem for check in CHECKS for problem in check(cfg)]


def _learner_topology(cfg: Config) -> Iterator[str]:
    learner = cfg.learner
    if learner.node_rank >= learner.nnodes:
        yield (f"learner.node_rank ({learner.node_rank}) must be below learner.nnodes "
               f"({learner.nnodes})")
    if learner.nnodes > 1 and learner.master_port == 0:
        yield ("learner.nnodes > 1 needs a fixed learner.master_port (every node must dial the "
               "same one; 0 picks a free port on one machine only)")


def _buffer_holds_a_step(cfg: Config) -> Iterator[str]:
    """The learner takes ``groups_per_step`` groups at once: a buffer that holds fewer never
    fills a step, and the learner failed only deep in a traceback."""
    held, step = cfg.buffer.max_groups, cfg.learner.groups_per_step
    if held < step:
        yield (f"buffer.max_groups = {held} is below learner.groups_per_step = {step}: the "
               "buffer could never hold one step's batch")


def _digit_positions(cfg: Config) -> Iterator[str]:
    """The tiny model's position table must hold a digit prompt and its longest response."""
    if cfg.workflow.type != "digits" or cfg.model.path:
        return
    needed = cfg.task.length + PROMPT_EXTRA_TOKENS + cfg.rollout.max_new_tokens
    table = cfg.model.tiny.max_position_embeddings
    if needed > table:
        yield (f"model.tiny.max_position_embeddings = {table} is shorter than the prompt "
               f"(task.length = {cfg.task.length}, + {PROMPT_EXTRA_TOKENS}) + "
               f"rollout.max_new_tokens = {cfg.rollout.max_new_tokens}: {needed} positions")


def _lora_backend(cfg: Config) -> Iterator[str]:
    """LoRA is built for the FSDP2 learner only (peft before ``fully_shard``)."""
    if cfg.model.lora.rank and cfg.learner.backend != "fsdp2":
        yield (f"model.lora.rank > 0 needs learner.backend = 'fsdp2' (got "
               f"{cfg.learner.backend!r}): LoRA is not built for that backend")


def _ports(cfg: Config) -> Iterator[str]:
    """Fixed ports must fit below 65536 and not be claimed twice by one run."""
    base, workers = cfg.monitor.prometheus_port, cfg.rollout.workers
    claimed: dict[int, str] = {}
    if base:
        last = base + PROMETHEUS_OFFSETS + workers - 1
        if last > 65535:
            yield (f"monitor.prometheus_port = {base} with rollout.workers = {workers} needs "
                   f"ports up to {last}, past 65535 (buffer +0, learner +1, worker i +2+i)")
        claimed.update({port: "monitor.prometheus_port range" for port in
                        range(base, min(last, 65535) + 1)})
    broker = cfg.buffer.zmq.port if selected_table(cfg, "buffer") == "zmq" else 0
    fixed = (("buffer.zmq.port", broker), ("learner.master_port", cfg.learner.master_port))
    for key, port in fixed:
        if port and port in claimed:
            yield f"{key} = {port} is also claimed by {claimed[port]}: give each its own port"
        elif port:
            claimed[port] = f"{key} = {port}"


def _restart_backoff(cfg: Config) -> Iterator[str]:
    """The backoff doubles at each consecutive restart: the last one must stay a real wait."""
    launcher = cfg.launcher
    if not launcher.max_restarts:
        return
    last = launcher.restart_backoff_s * 2 ** (launcher.max_restarts - 1)
    if last > WEEK_S:
        yield (f"launcher.restart_backoff_s = {launcher.restart_backoff_s} doubled up to "
               f"launcher.max_restarts = {launcher.max_restarts} times waits {last:.3g} s "
               f"before the last restart, over a week ({WEEK_S:.0f} s)")


def _colocate(cfg: Config) -> Iterator[str]:
    """The hybrid mode time-slices shared devices: every engine must be able to give its
    memory back while the learner steps, and the learner its own while engines generate."""
    if not cfg.launcher.colocate:
        return
    engine = cfg.rollout.engine
    if not engine_kind(engine).sleeps:
        able = " or ".join(repr(k.name) for k in ENGINE_KINDS.values() if k.sleeps)
        yield (f"launcher.colocate = true needs engines that can sleep, and rollout.engine = "
               f"{engine!r} cannot yet: use rollout.engine = {able} or "
               "launcher.colocate = false")
    if cfg.learner.backend != "fsdp2":
        yield (f"launcher.colocate = true needs learner.backend = 'fsdp2' (got "
               f"{cfg.learner.backend!r}): only its state is moved to host between steps")
    if cfg.learner.device != cfg.rollout.device:
        yield (f"launcher.colocate = true shares the devices: learner.device "
               f"({cfg.learner.device!r}) and rollout.device ({cfg.rollout.device!r}) must "
               "be the same")


def _weights_transport(cfg: Config) -> Iterator[str]:
    """A transport whose buckets live in CUDA memory needs the learner there."""
    from asyncrl.weights.transport import transport_kind  # torch-free

    if transport_kind(cfg.weights.transport).needs_cuda and cfg.learner.device == "cpu":
        yield (f"weights.transport ({cfg.weights.transport!r}) moves CUDA buckets, but "
               "learner.device is 'cpu' (set learner.device = 'cuda', or weights.transport = "
               "'auto' or 'gloo')")
    yield from _engine_weights_transport(cfg)


def _engine_weights_transport(cfg: Config) -> Iterator[str]:
    """What the engine kind cannot take of ``weights.transport`` (its descriptor says)."""
    refusal = engine_kind(cfg.rollout.engine).transport_refusal
    reason = refusal(cfg) if refusal is not None else None
    if reason:
        yield reason


def _weights_fanout(cfg: Config) -> Iterator[str]:
    """``weights.fanout = true`` where every rank cannot hold the state to send."""
    from asyncrl.weights.senders import fanout_refusal  # torch-free

    why = fanout_refusal(cfg) if cfg.weights.fanout is True else None
    if why is not None:
        yield f"weights.fanout = true: {why}; set weights.fanout = 'auto' or false"


def _routing_replay(cfg: Config) -> Iterator[str]:
    """Routing replay needs an MoE model and an engine that records routing."""
    if not cfg.learner.routing_replay:
        return
    if not cfg.model.path and not cfg.model.tiny.num_experts:
        yield ("learner.routing_replay = true needs an MoE model: model.tiny.num_experts = 0 "
               "builds a dense one (no router to replay)")
    kind = engine_kind(cfg.rollout.engine)
    if not kind.records_routing:
        yield (f"learner.routing_replay = true: rollout.engine = {kind.name!r} "
               f"{kind.routing_note}")
    elif kind.routing_refusal is not None and (why := kind.routing_refusal(cfg)):
        yield why


def _vision(cfg: Config) -> Iterator[str]:
    """The colour task's ids are the tiny VLM's; the tiny VLM trains on FSDP2 (the DeepSpeed
    backend and the GAE critic load causal LMs only)."""
    tiny_vlm = not cfg.model.path and cfg.model.tiny.vision.depth > 0
    if cfg.workflow.type == "digits" and cfg.task.name == "colour" and not tiny_vlm:
        yield ("task.name = \"colour\" needs the tiny vision-language model: model.path = \"\" "
               "and model.tiny.vision.depth > 0")
    if tiny_vlm and cfg.learner.backend == "deepspeed":
        yield ("model.tiny.vision.depth > 0 (a vision-language model) needs "
               "learner.backend = \"fsdp2\", not \"deepspeed\"")
    images = (cfg.workflow.type == "digits" and cfg.task.name == "colour") or cfg.data.image_field
    if images and not engine_kind(cfg.rollout.engine).takes_images:
        yield (f"rollout.engine = \"{cfg.rollout.engine}\" does not take images yet "
               "(task.name = \"colour\" or data.image_field): use an engine that does "
               f"({', '.join(k.name for k in ENGINE_KINDS.values() if k.takes_images)})")
    if tiny_vlm and cfg.learner.loss.advantage == "gae":
        yield ("model.tiny.vision.depth > 0 (a vision-language model) has no critic: "
               "learner.loss.advantage = \"gae\" is not supported with it")


CHECKS: tuple[Callable[[Config], Iterator[str]], ...] = (
    _learner_topology, _buffer_holds_a_step, _digit_positions, _lora_backend, _ports,
    _restart_backoff, _colocate, _weights_transport, _weights_fanout, _routing_replay,
    _vision)
"""Every cross-section rule, in the order their problems are reported."""
