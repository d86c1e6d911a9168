"""The config schema. Every field says what it means; validation is local to its component.

Cross-component checks (``learner.node_rank`` below ``learner.nnodes``) live in
:mod:`asyncrl.config.checks`, run by :meth:`Config._check_consistency`: they only reject,
never rewrite a sibling section. The bounds, and the strict and finite types every section
holds its values to: :mod:`asyncrl.config.limits`.
"""

from __future__ import annotations

import functools
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from asyncrl.config.checks import consistency_problems
from asyncrl.config.limits import (MAX_BUCKET_MB, MAX_GROUP, MAX_GROUPS, MAX_MB,
                                   MAX_PROCESSES, MAX_SEED, MAX_STEPS, MAX_THREADS,
                                   MAX_TOKENS, MODULE_PATTERN, WEEK_S, Host, Name, PathName,
                                   Seconds)
from asyncrl.engine_kinds import engine_kind


_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, models are immutable, types
    are strict (``true`` is no integer, ``2.0`` no count) and floats finite (no inf, nan);
    bounds live in :mod:`asyncrl.config.limits`."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              strict=True, allow_inf_nan=False)

    def with_fields(self: _S, path: str = "", /, **fields: Any) -> _S:
        """A copy with ``fields`` replaced in the sub-section at the dotted ``path`` ("" for
        this one), e.g. ``cfg.buffer.with_fields("zmq", reconnect_s=0.0)``. Not validated,
        as ``model_copy`` is not: for values known to be valid."""
        if not path:
            return self.model_copy(update=fields)
        head, _, rest = path.partition(".")
        return self.model_copy(update={head: getattr(self, head).with_fields(rest, **fields)})


class RunConfig(Section):
    name: str = Field("run", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: PathName = Field(Path("runs"), strict=False, description="Parent of run "
                                                                     "directories.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Base seed; each role and rank "
                                                        "derives its own.")

    @model_validator(mode="after")
    def _check_name(self) -> RunConfig:
        if self.name in (".", ".."):
            raise ValueError(f"run.name = {self.name!r} would put the run directory outside "
                             "run.output_dir: use a name such as 'quickstart'")
        return self


class TinyVisionConfig(Section):
    """The tiny model's vision tower (``depth > 0``: a Qwen2-VL vision-language model,
    :mod:`asyncrl.vlm`); every image is resized to ``image_size``² pixels."""

    depth: int = Field(0, ge=0, le=64, description="Vision blocks; 0: a text-only model.")
    embed_dim: int = Field(32, ge=8, le=8192, description="Vision width; num_heads divides it.")
    num_heads: int = Field(2, ge=1, le=64, description="Vision attention heads.")
    mlp_ratio: int = Field(2, ge=1, le=16, description="Vision MLP width / embed_dim.")
    patch_size: int = Field(14, ge=2, le=64, description="Pixels per patch side.")
    merge_size: int = Field(2, ge=1, le=8, description="Patches merged per token, per side.")
    image_size: int = Field(28, ge=8, le=1024, description="Pixels per image side after "
                                                          "resizing: a multiple of "
                                                          "patch_size × merge_size.")

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyVisionConfig:
        key = "model.tiny.vision"
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 2:
            raise ValueError(f"{key}.num_heads = {self.num_heads} must divide {key}.embed_dim "
                             f"= {self.embed_dim} into even head sizes")
        if self.image_size % (self.patch_size * self.merge_size):
            raise ValueError(f"{key}.image_size = {self.image_size} must be a multiple of "
                             f"patch_size × merge_size = {self.patch_size * self.merge_size}")
        return self


class TinyModelConfig(Section):
    """A random-init Qwen2-style model built in code (used when ``model.path`` is empty)."""

    hidden_size: int = Field(64, ge=8, le=16384, description="Model width; num_heads divides "
                                                            "it into even head sizes.")
    num_layers: int = Field(2, ge=1, le=256, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, le=256, description="Attention (query) heads.")
    num_kv_heads: int = Field(2, ge=1, le=256, description="Key/value heads (GQA): a divisor "
                                                          "of num_heads.")
    intermediate_size: int = Field(256, ge=8, le=65536, description="MLP width.")
    max_position_embeddings: int = Field(64, ge=8, le=MAX_TOKENS,
                                         description="Longest prompt + response, in tokens.")
    extra_tokens: list[str] = Field(default_factory=list,
                                    description="Whole-word tokens appended to the digit "
                                                "vocabulary (e.g. [\"lookup(\", \")\"] for the "
                                                "lookup agent env).")
    num_experts: int = Field(0, ge=0, le=256, description="0: a dense Qwen2 model; N > 0: a "
                                                         "Qwen3-MoE model with N experts in "
                                                         "every layer.")
    num_experts_per_tok: int = Field(2, ge=1, le=64, description="Experts each token is "
                                                                "routed to (MoE only).")
    moe_intermediate_size: int = Field(64, ge=8, le=65536, description="Each expert's MLP "
                                                                      "width (MoE only).")
    vision: TinyVisionConfig = Field(default_factory=TinyVisionConfig,
                                     description="A vision tower (depth > 0): a Qwen2-VL model.")

    @model_validator(mode="after")
    def _check_heads(self) -> TinyModelConfig:
        """What Qwen2 needs of its shapes; a worker building a model without it crashed,
        and was restarted, for minutes (``model.tiny.*`` named nowhere)."""
        key = "model.tiny"
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{key}.num_heads = {self.num_heads} must divide {key}.hidden_size "
                             f"= {self.hidden_size} (each head gets hidden_size / num_heads "
                             "dimensions)")
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{key}.num_kv_heads = {self.num_kv_heads} must divide "
                             f"{key}.num_heads = {self.num_heads} (each key/value head serves "
                             "num_heads / num_kv_heads query heads)")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"{key}.hidden_size / {key}.num_heads = "
                             f"{self.hidden_size // self.num_heads} must be even (rotary "
                             "position embeddings rotate pairs of dimensions)")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{key}.num_experts_per_tok = {self.num_experts_per_tok} must not "
                             f"exceed {key}.num_experts = {self.num_experts}")
        if self.vision.depth and self.num_experts:
            raise ValueError(f"{key}.vision.depth > 0 builds a Qwen2-VL model, which has no "
                             f"experts: set {key}.num_experts = 0")
        if self.vision.depth and (self.hidden_size // self.num_heads) % 8:
            raise ValueError(f"{key}.hidden_size / {key}.num_heads must be a multiple of 8 "
                             "with a vision tower (M-RoPE splits the rotary pairs in three)")
        if any(not token.strip() for token in self.extra_tokens) or \
                len(set(self.extra_tokens)) != len(self.extra_tokens):
            raise ValueError(f"{key}.extra_tokens must be distinct, non-blank tokens, got "
                             f"{self.extra_tokens}")
        return self


SPILL_AUTO = "auto"  # buffer.zmq.spill_path: the run directory's buffer.spill
SPILL_NAME = "buffer.spill"
DATA_POSITION_DIR = "data"  # in the run directory: each rollout worker's place in data.path
LORA_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters on the policy (peft), trained instead of the full weights; rank 0 = off.

    Only the adapters are trainable (and in the optimizer); the base weights, embeddings and
    head stay frozen. The torch engine receives the adapters alone and merges them into its own
    base copy; other engines, evaluation and HF exports get merged weights (``learners.lora``).
    No dropout: the learner runs in eval mode so that, on-policy, its logprobs equal the
    engine's (an importance ratio of exactly 1), and LoRA dropout would break that."""

    rank: int = Field(0, ge=0, le=4096, description="Adapter rank r; 0 turns LoRA off (full "
                                                   "training).")
    alpha: float = Field(16.0, gt=0, le=1e4, description="Scaling numerator: the update is "
                                                 "(alpha / rank) · B·A.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_ALL_LINEAR),
        description="Names (last path component) of the linear modules that get adapters; "
                    "the default is every linear layer of a Qwen2/Llama decoder.")

    @model_validator(mode="after")
    def _check_targets(self) -> LoraConfig:
        if self.rank and not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name the linear modules "
                             "that get adapters (e.g. [\"q_proj\", \"v_proj\"])")
        bad = [m for m in self.target_modules if not m or "." in m]
        if bad or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"model.lora.target_modules must be distinct module names "
                             f"without dots, got {self.target_modules}")
        return self

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of B·A in the merged weight."""
        return self.alpha / self.rank if self.rank else 0.0


class ModelConfig(Section):
    path: Name = Field("", description="HF model directory or hub id; empty builds `tiny` in code.")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    freeze_vision: bool = Field(True, description="VLMs: the vision tower is not trained "
                                "(as verl) and weight updates leave it out.")
    lora: LoraConfig = Field(default_factory=LoraConfig,
                             description="LoRA adapters (rank 0 = off: full training).")
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "flex_attention", "eager",
                                 "varlen_sdpa"] = Field(
        "auto", description="The learner's attention kernel. Packed micro-batches run varlen "
        "(no attention across sequences, no dense mask) with flash_attention_2, "
        "flex_attention (CUDA only: no CPU backward) or varlen_sdpa (sdpa per sequence); "
        "auto = flash_attention_2 where flash-attn and CUDA are, else varlen_sdpa (sdpa for "
        "sliding-window models); the pick is logged (learners/attention.py).")


class TaskConfig(Section):
    name: Literal["copy", "reverse", "sort", "colour"] = Field(
        "copy", description="Built-in task: a digit task, or colour (name an image's colour; "
                            "a vision-language model, model.tiny.vision).")
    length: int = Field(4, ge=1, le=32, description="Digits per prompt.")
    eval_size: int = Field(256, ge=1, le=1_000_000,
                           description="Held-out prompts for greedy evaluation.")


class RewardConfig(Section):
    """How a response is scored (workflows `single_turn` and `multi_turn`; digit tasks score
    themselves). Rewards that raise or time out score 0 and are counted."""

    type: Literal["exact", "math", "code", "custom", "verl"] = Field(
        "exact", description="exact: extracted answer == data answer field; math: equivalence "
                             "by math-verify; code: run the response with the row's tests in "
                             "a sandbox; custom: the function at `path`; verl: a verl "
                             "compute_score at `path`, or without one verl's built-in scorer "
                             "for each row's data_source (GSM8K, MATH, else exact match).")
    path: Name = Field("", description="custom: import path 'pkg.module:fn' (or a file, "
                                      "'path/to/file.py:fn') of fn(response, sample) -> float, "
                                      "sync or async; verl: 'pkg.module:compute_score' or "
                                      "'file.py:compute_score' of compute_score(data_source, "
                                      "solution_str, ground_truth, extra_info), sync or async.")
    timeout_s: Seconds = Field(30.0, gt=0, description="A reward call still running after "
                                                     "this scores 0 (counted as a timeout) and "
                                                     "is abandoned.")
    isolation: Literal["process", "thread"] = Field(
        "process", description="Where custom, verl and math rewards run. process: a pool of "
                               "`workers` processes; a call past timeout_s is killed with its "
                               "process, which is replaced. thread: in the rollout worker (sync "
                               "on `workers` threads, async on its event loop); a call past "
                               "timeout_s keeps running on an abandoned thread. exact and code "
                               "always run in the worker.")
    workers: int = Field(4, ge=1, le=256, description="Reward calls run at once by each rollout "
                                                      "worker: processes or threads.")
    tests_field: Name = Field("tests", description="code: data field holding the tests "
                                                  "(Python source); falls back to the answer.")
    code_wall_s: Seconds = Field(10.0, gt=0, description="code: wall-clock limit per program.")
    code_cpu_s: int = Field(5, ge=1, le=int(WEEK_S), description="code: CPU-seconds limit "
                                                                 "(RLIMIT_CPU).")
    code_memory_mb: int = Field(512, ge=64, le=MAX_MB, description="code: address-space limit "
                                                                   "(RLIMIT_AS).")
    code_max_processes: int = Field(16, ge=1, le=MAX_PROCESSES,
                                    description="code: extra processes allowed.")

    @model_validator(mode="after")
    def _check_path(self) -> RewardConfig:
        if self.type == "custom" and not self.path:
            raise ValueError("reward.type = 'custom' needs reward.path ('pkg.module:fn')")
        return self


class DataConfig(Section):
    """Where prompts come from for `single_turn` and `multi_turn` workflows.

    Rows are read from a JSONL file, a Parquet file, a local HF ``datasets`` directory (one
    saved with ``save_to_disk``) or a hub dataset id. Each row becomes a sample:
    ``prompt_template`` formatted with the row's fields, the ``answer_field`` value, and the
    row itself for rewards and envs. verl's layout (``prompt`` a list of chat messages,
    ``reward_model.ground_truth``, ``data_source``, ``extra_info``) is read as it is.
    Empty ``path`` with a built-in env: the env generates its own prompts."""

    path: Name = Field("", description="Training rows: .jsonl, .parquet, a datasets dir, or a "
                                       "hub dataset id (e.g. openai/gsm8k, with data.split).")
    format: Literal["auto", "jsonl", "parquet", "hf", "verl"] = Field(
        "auto", description="File format; auto picks by suffix (a directory is `hf`, a hub id "
                            "goes through datasets.load_dataset) and reads verl's layout when "
                            "the rows have it; verl: that layout, required.")
    split: Name = Field("train", min_length=1, description="hf: split to use when the "
                                                         "directory holds a DatasetDict.")
    prompt_template: str = Field("{prompt}", min_length=1,
                                 description="Python format string over the row's fields, "
                                             "e.g. 'Q: {question}'.")
    answer_field: Name = Field("answer", description="Row field compared by the reward, a "
                                                    "dotted path into nested fields allowed "
                                                    "(empty: none; verl layout: "
                                                    "reward_model.ground_truth).")
    id_field: Name = Field("", description="Row field used as the sample id, dotted paths "
                                          "allowed (empty: the row index).")
    image_field: Name = Field("", description="Row field holding the prompt's images, for a "
                                             "vision-language model: a list (or one) of file "
                                             "paths, encoded bytes, or {bytes, path} objects "
                                             "(verl's `images` column: \"images\"); each "
                                             "<image> in the prompt marks where one goes "
                                             "(none: all before the text). Empty: no images.")
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded by data.seed + epoch).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Shuffle seed.")
    epochs: int = Field(0, ge=0, le=MAX_STEPS,
                        description="Passes over the data; 0 = no limit. The run ends when every "
                                    "rollout worker's share ran out.")
    eval_path: Name = Field("", description="Held-out rows for validation (same format and "
                                           "template); empty with a built-in env: its own.")
    eval_size: int = Field(0, ge=0, le=MAX_STEPS,
                           description="Validate on the first N held-out rows; 0 = all.")
    name: Name = Field("", description="Task name in val/test_score/<name>; empty: the file stem "
                                      "or the env name.")
    max_prompt_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                          description="Samples whose prompt is longer (in "
                                                      "tokens) are skipped, each episode "
                                                      "counted in rollout/episodes_prompt_"
                                                      "too_long, never cut; unset: no limit.")

    @model_validator(mode="after")
    def _check_template(self) -> DataConfig:
        check_template(self.prompt_template)
        return self


def check_template(template: str) -> None:
    """Raise ``ValueError`` naming ``data.prompt_template`` for a template ``str.format`` cannot
    use on a row: unbalanced braces, or a positional field (``{}``, ``{0}``) where a row has
    only names. Whether each row has the fields is checked on the rows
    (:func:`rollouters.tasks.data.row_problem`)."""
    key = "data.prompt_template"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{key} = {template!r} is not a format string: {exc} (write a "
                         "literal brace as {{ or }})") from None
    for _, field, spec, _ in parsed:
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise ValueError(f"{key} = {template!r}: {{{field}}} is positional; name a row "
                             "field instead, e.g. {question}")
        if spec and "{" in spec:  # a nested field: '{x:>{width}}'
            check_template(spec)


class WorkflowConfig(Section):
    """What an episode is. `digits`: the built-in digit tasks ([task]). `single_turn`: prompt
    → response → [reward]. `multi_turn`: the agent loop over an environment. `custom`: your
    ``async def run_episode(engine, sample)``."""

    type: Literal["digits", "single_turn", "multi_turn", "custom"] = Field(
        "digits", description="Episode kind (see the section's doc).")
    path: Name = Field("", description="custom: import path 'pkg.module:name' of an async "
                                      "run_episode(engine, sample) function, or of a factory "
                                      "called with (ctx) that returns an object having one.")
    env: Name = Field("", description="multi_turn: a built-in env ('lookup') or the import path "
                                     "'pkg.module:Env' of a class/factory making one env.")
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="Keyword arguments for the env factory.")
    tool_format: Literal["hermes", "compact"] = Field(
        "hermes", description="Tool calls: hermes '<tool_call>{json}</tool_call>', or compact "
                              "'name(arg)' for tiny vocabularies.")
    max_turns: int = Field(4, ge=1, le=1000,
                           description="multi_turn: most model turns per episode.")
    system_prompt: str = Field("", description="Optional system message.")
    chat_template: bool = Field(True, description="single_turn: render the prompt through the "
                                                  "tokenizer's chat template (else raw text).")
    stale_policy: Literal["drop", "requeue"] = Field(
        "requeue", description="An episode whose oldest token would be more than "
                               "buffer.max_staleness versions old is dropped, or restarted "
                               "from its first turn (requeue; at most max_requeues times).")
    max_requeues: int = Field(2, ge=0, le=1000, description="requeue: restarts before a drop.")
    episode_timeout_s: Seconds = Field(600.0, gt=0, description="An episode still running after "
                                                              "this is dropped, counted.")

    @model_validator(mode="after")
    def _check_paths(self) -> WorkflowConfig:
        if self.type == "custom" and not self.path:
            raise ValueError("workflow.type = 'custom' needs workflow.path ('pkg.module:name')")
        if self.type == "multi_turn" and not self.env:
            raise ValueError("workflow.type = 'multi_turn' needs workflow.env (a built-in env "
                             "such as 'lookup', or 'pkg.module:Env')")
        return self


class ZmqBufferConfig(Section):
    """The ZMQ backend (``buffer.type = "zmq"``): an embedded broker process (``asyncrl
    buffer``) that the roles dial; these keys are read only by the broker and its clients."""

    host: Host = Field("127.0.0.1", description="Address the broker binds and clients dial.")
    port: int = Field(5555, ge=0, le=65535, description="Broker port; 0 picks a free one.")
    auth: Literal["none", "curve"] = Field("none", description="Authentication: CURVE keys.")
    curve_keys_dir: Name = Field("", description="Directory with the CURVE key pairs.")
    spill_path: Name = Field(SPILL_AUTO,
                            description="Append-only file so a broker restart loses nothing "
                                        "accepted and unacked. 'auto': <run_dir>/buffer.spill "
                                        "(a fresh `asyncrl up` sets the previous run's aside, "
                                        "a resumed one replays it); empty: memory only.")
    io_threads: int = Field(2, ge=1, le=16,
                            description="The broker's I/O threads (socket reads and writes, "
                                        "beside its one thread of Python). 2 moves large "
                                        "groups 14-20 % faster than 1 on a 16-core host and "
                                        "made no difference on 2 cores; small groups are bound "
                                        "by the Python thread.")
    reconnect_s: Seconds = Field(60.0, ge=0, description="How long a client keeps retrying a "
                                                       "request that timed out (the broker is "
                                                       "restarting) before giving up; puts are "
                                                       "never retried. 0: no retries.")

    @model_validator(mode="after")
    def _check_curve(self) -> ZmqBufferConfig:
        if self.auth == "curve" and not self.curve_keys_dir:
            raise ValueError("buffer.zmq.auth = 'curve' needs buffer.zmq.curve_keys_dir (the "
                             "directory of the CURVE key pairs)")
        return self


class RedisBufferConfig(Section):
    """The Redis backend (``buffer.type = "redis"``): Redis Streams, multi-node and durable.
    Redis is then the broker and `asyncrl buffer` is not needed; every client applies the gate
    itself."""

    url: str = Field("redis://127.0.0.1:6379/0",
                     pattern=r"^(redis|rediss|unix)://\S+$",
                     description="Redis URL (redis://, rediss:// for TLS, or unix:// for a "
                                 "socket).")
    namespace: Name = Field("", description="Key prefix; empty uses asyncrl:<run.name> (on a "
                                           "cluster wrapped in a {hash tag}).")
    cluster: Literal["auto", "yes", "no"] = Field(
        "auto", description="Is buffer.redis.url a Redis Cluster node? auto asks it (INFO "
                            "cluster; an ACL user refused INFO is taken as a single server).")
    username: Name = Field("", description="ACL user (empty: default user).")
    password: str = Field("", description="Password (or the ACL user's password).")
    tls_ca_file: Name = Field("", description="CA bundle to verify the server (TLS).")
    tls_cert_file: Name = Field("", description="Client certificate for mutual TLS.")
    tls_key_file: Name = Field("", description="Client key for mutual TLS.")


class BufferConfig(Section):
    """The replay buffer: what every backend obeys here, each backend's own keys in its
    sub-table (``[buffer.zmq]``, ``[buffer.redis]``); only the one ``type`` names is read."""

    type: Literal["zmq", "redis"] = Field(
        "zmq", description="Buffer backend: embedded ZMQ broker, or Redis Streams (multi-node, "
                           "durable; Redis is then the broker and `asyncrl buffer` is not needed).")
    max_staleness: int = Field(2, ge=0, le=1000,
                               description="s: never train on a sample staler than s.")
    staleness_mode: Literal["drop", "pace"] = Field(
        "drop", description="drop: a group that finished staler than s is dropped and "
                            "counted. pace: no finished group is dropped; the learner waits "
                            "(buffer/pace_held_s) rather than step past the version at which "
                            "a group still queued or generating would go stale.")
    max_groups: int = Field(4096, ge=1, le=MAX_GROUPS,
                            description="Most groups held before producers wait; at least "
                                        "learner.groups_per_step (a step's batch).")
    max_message_bytes: int = Field(64 << 20, ge=1024, le=1 << 31,
                                   description="Larger trajectory groups are rejected.")
    reclaim_idle_s: Seconds = Field(60.0, gt=0,
                                  description="Groups delivered but neither acked nor renewed "
                                              "for this long (a dead learner) are redelivered; "
                                              "a live learner renews every reclaim_idle_s / 3.")
    heartbeat_timeout_s: Seconds = Field(15.0, gt=0,
                                       description="A silent rollout worker's in-flight groups "
                                                   "are released after this long.")
    request_timeout_s: Seconds = Field(30.0, gt=0, description="Client-side request timeout.")
    zmq: ZmqBufferConfig = Field(default_factory=ZmqBufferConfig,
                                 description="buffer.type = 'zmq': the broker's own keys.")
    redis: RedisBufferConfig = Field(default_factory=RedisBufferConfig,
                                     description="buffer.type = 'redis': the Redis server's "
                                                 "own keys.")


class VllmRolloutConfig(Section):
    """vLLM (``rollout.engine = "vllm"``, and ``"vllm-server"``: the servers a worker launches
    itself, and the sampling keys): how it runs, what it serves with, how it samples."""

    mode: Literal["async", "inprocess"] = Field(
        "async", description="async: vLLM's AsyncLLM, its engine core in a process of its own "
                             "(scheduling overlapped with the forward; tensor/data parallelism); "
                             "inprocess: LLMEngine stepped in the worker's own process, one "
                             "process per engine (small CPU machines, CI).")
    kv_cache_memory_mb: int | None = Field(None, ge=0, le=MAX_MB,
                                           description="KV cache size (MB); 0 sizes it from "
                                                       "gpu_memory_utilization; unset follows "
                                                       "the device: 64 on CPU, 0 on GPU.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1,
                                          description="On GPU: fraction of the device's memory "
                                                      "the engine may take.")
    enforce_eager: bool | None = Field(None, description="No CUDA graphs / torch.compile; unset "
                                                         "follows the device: eager on CPU, "
                                                         "CUDA graphs on GPU.")
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_PROCESSES,
                                      description="GPUs one engine shards the model over (async "
                                                  "mode).")
    data_parallel_size: int = Field(1, ge=1, le=MAX_PROCESSES,
                                    description="Engine replicas behind one worker's AsyncLLM "
                                                "(async mode).")
    max_num_seqs: int | None = Field(None, ge=1, le=MAX_GROUPS,
                                     description="Rows one engine step may hold; unset: 256 or "
                                                 "one batch (groups_per_batch x group_size), "
                                                 "whichever is more.")
    max_model_len: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                      description="Longest prompt + response; unset: the "
                                                  "model's own.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (behaviour logprobs "
                                                      "are then of the truncated distribution).")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="Top-k sampling; 0: off.")
    stop: list[str] = Field(default_factory=list,
                            description="Stop strings (loads the tokenizer to detokenize).")
    stop_token_ids: list[int] = Field(default_factory=list,
                                      description="Token ids that end a row, besides the "
                                                  "model's EOS ids.")
    engine_args: dict[str, Any] = Field(default_factory=dict,
                                        description="Anything else, passed to vLLM's "
                                                    "EngineArgs as it is (each key must be one "
                                                    "of its fields).")
    server_start_timeout_s: Seconds = Field(600.0, gt=0, description="vllm-server without "
                                                                   "url: how long a launched "
                                                                   "server may take to get "
                                                                   "ready.")

    @model_validator(mode="after")
    def _check_vllm(self) -> VllmRolloutConfig:
        if self.mode == "inprocess" and self.tensor_parallel_size * self.data_parallel_size > 1:
            raise ValueError("rollout.vllm.mode = 'inprocess' runs one worker: "
                             "tensor_parallel_size and data_parallel_size must be 1 (use "
                             "mode = 'async')")
        known = vllm_engine_arg_names() if self.engine_args else set()
        unknown = sorted(set(self.engine_args) - known) if known else []
        if unknown:
            raise ValueError(f"rollout.vllm.engine_args.{unknown[0]}: not a field of vLLM's "
                             "EngineArgs")
        return self


@functools.lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset[str]:
    """The field names of vLLM's ``EngineArgs``, read from its source without importing vLLM
    (seconds, and torch); empty where vLLM is not installed (the engine checks again).

    Parsing that file costs ~45 ms of CPU, which every config validation paid, twice, with or
    without ``engine_args`` (the config fuzz test spent 23 of its 24 s there): it is read only
    when there are keys to check, once per process (the installed vLLM does not change)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return frozenset(item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign)
                             and isinstance(item.target, ast.Name))
    return frozenset()


class SglangRolloutConfig(Section):
    """SGLang servers (``rollout.engine = "sglang"``) launched by the workers themselves, one
    each, when ``rollout.url`` is empty; with a ``url`` only ``pause_mode`` is read."""

    pause_mode: Literal["retract", "in_place"] = Field(
        "retract", description="How generation pauses for a weight update: retract (running "
        "requests wait in SGLang's queue and their KV cache is recomputed with the new "
        "weights; the update flushes the prefix cache) or in_place (they keep their KV cache; "
        "no flush, so prompts cached with older weights are reused).")

    module: str = Field("sglang.launch_server", pattern=MODULE_PATTERN,
                        description="The module each worker runs (`python -m`) to launch its "
                                    "own server.")
    args: list[str] = Field(default_factory=list,
                            description="Extra launch flags (e.g. --mem-fraction-static 0.5).")
    server_start_timeout_s: Seconds = Field(600.0, gt=0, description="How long a launched server "
                                                                   "may take to get ready.")


class RolloutConfig(Section):
    """The rollout fleet: what every engine uses here, each engine's own keys in its sub-table
    (``[rollout.vllm]``, ``[rollout.sglang]``); only the one ``engine`` names is read."""

    engine: Literal["torch", "vllm", "vllm-server", "sglang", "sim"] = Field(
        "torch", description="Inference engine: pure-torch reference, vLLM (see "
                             "[rollout.vllm]), vLLM OpenAI servers (at `url`, or one launched "
                             "per worker), SGLang servers (at `url`, or one launched per worker), "
                             "or `sim`: calibrated waits instead of compute (see [sim]); sim "
                             "workers run as threads of one process.")
    url: Name = Field("", description="vllm-server, sglang: base URL(s) of the server(s), comma-"
                                     "separated, one per worker (worker i attaches to entry i).")
    request_timeout_s: Seconds = Field(120.0, gt=0, description="vllm-server, sglang: HTTP "
                                                              "timeout.")
    workers: int = Field(2, ge=1, le=MAX_PROCESSES,
                         description="Rollout worker processes (one engine each).")
    group_size: int = Field(16, ge=1, le=MAX_GROUP, description="Samples per prompt (G).")
    groups_per_batch: int = Field(8, ge=1, le=MAX_GROUP,
                                  description="Groups generated in one engine call.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    max_new_tokens: int = Field(8, ge=1, le=MAX_TOKENS, description="Generation length limit.")
    threads: int = Field(1, ge=1, le=MAX_THREADS, description="torch threads per worker.")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="Engine device.")
    vllm: VllmRolloutConfig = Field(default_factory=VllmRolloutConfig,
                                    description="rollout.engine = 'vllm': the engine's own keys.")
    sglang: SglangRolloutConfig = Field(default_factory=SglangRolloutConfig,
                                        description="rollout.engine = 'sglang': launching its "
                                                    "servers.")

    @model_validator(mode="after")
    def _check_server_url(self) -> RolloutConfig:
        if engine_kind(self.engine).needs_url and not self.url.strip():
            raise ValueError(f"rollout.engine = {self.engine!r} needs rollout.url (the server "
                             "fleet)")
        urls = [u.strip() for u in self.url.split(",") if u.strip()]
        bad = [u for u in urls if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", u)]
        if bad:
            raise ValueError(f"rollout.url = {self.url!r}: {bad[0]!r} is not an http:// or "
                             "https:// URL")
        if urls and len(urls) < self.workers:
            raise ValueError(f"rollout.workers = {self.workers} but rollout.url names "
                             f"{len(urls)} server(s): one server per worker (worker i attaches "
                             "to entry i, and a server takes weights from one worker only)")
        return self


class CorrectionConfig(Section):
    """Rollout correction (``learners.losses.correction``): importance weights and rejection
    masks on the learner-vs-engine ratio ρ = π_old/π_rollout, after verl's rollout correction
    and IcePop. Off by default."""

    is_level: Literal["none", "token", "sequence"] = Field(
        "none", description="Truncated importance weight: token min(ρ_t, is_cap), or sequence "
                            "min(Π ρ_t, is_cap). Only for reinforce and decoupled_ppo (it "
                            "replaces the latter's min(ρ, tis_cap)): the other losses' ratio "
                            "already holds ρ.")
    is_cap: float = Field(2.0, gt=0, le=1e4, description="Truncation C of the weights.")
    mask: Literal["none", "token", "sequence", "icepop"] = Field(
        "none", description="Rejection: token drops tokens with ρ_t outside [mask_low, "
                            "mask_high]; sequence drops samples whose geometric-mean ratio is "
                            "outside; icepop drops the tokens outside and weights the rest by "
                            "ρ_t (the weight only where the loss's ratio does not hold ρ).")
    mask_low: float = Field(0.5, gt=0, le=1, description="Lower end of the kept band.")
    mask_high: float = Field(2.0, ge=1, le=1e4, description="Upper end of the kept band.")

    @model_validator(mode="after")
    def _check_icepop(self) -> CorrectionConfig:
        if self.mask == "icepop" and self.is_level != "none":
            raise ValueError("learner.loss.correction.mask = 'icepop' weights the tokens it "
                             "keeps by ρ itself: set correction.is_level = 'none' (or use "
                             "mask = 'token' with the weights)")
        return self


class LossConfig(Section):
    """The learner's objective: policy loss, advantage estimator, aggregation, KL, filters.

    Defaults reproduce plain token-level PPO-clip with GRPO advantages and no KL.
    """

    policy_loss: Literal["ppo_clip", "decoupled_ppo", "tis", "gspo", "reinforce"] = Field(
        "ppo_clip", description="ppo_clip: clip against the behaviour logprobs; decoupled_ppo: "
                                "clip against proximal logprobs recomputed by the learner, "
                                "behaviour/proximal weight capped at tis_cap; tis: policy "
                                "gradient with the importance weight truncated at tis_cap; "
                                "gspo: clipped sequence-level (length-normalised) ratio; "
                                "reinforce: −A·log π, no ratio.")
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo", description="grpo: (r − group mean)/group std (std only if "
                            "learner.advantage_std_norm); dr_grpo: r − group mean; rloo: "
                            "leave-one-out baseline; reinforce_pp: r − group mean, divided by "
                            "the std over the rank's batch; gae: GAE with a learned critic "
                            "(a value head on a copy of the model, trained alongside).")
    step_advantage: Literal["broadcast", "per_step"] = Field(
        "broadcast", description="Multi-step trajectories: broadcast the trajectory's "
                                 "advantage to every step, or per_step: each step's "
                                 "return-to-go normalised with the same step of the group's "
                                 "other trajectories (advantage grpo, dr_grpo or rloo).")
    step_gamma: float = Field(1.0, gt=0, le=1, description="per_step: discount γ per step.")
    gae_gamma: float = Field(1.0, gt=0, le=1, description="GAE discount γ per token.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE λ: 0 trusts the critic, 1 is "
                                                            "Monte-Carlo.")
    critic_lr: float | None = Field(None, gt=0, lt=1, description="Critic AdamW peak lr; None "
                                    "uses learner.lr. The critic follows the actor's schedule "
                                    "(learner.lr_schedule, lr_min_ratio, total_steps) and "
                                    "learner.offload.")
    critic_lr_warmup_steps: int | None = Field(
        None, ge=0, le=MAX_STEPS, description="Critic steps of linear warmup to critic_lr; None "
        "uses learner.lr_warmup_steps.")
    aggregation: Literal["token", "sequence", "group"] = Field(
        "token", description="token: mean over all trained tokens; sequence: mean over "
                             "samples of each sample's token mean; group: mean over groups of "
                             "each group's token mean.")
    clip_eps_high: float | None = Field(None, gt=0, le=10,
                                        description="Upper clip 1 + clip_eps_high (DAPO "
                                                    "clip-higher, e.g. 0.28); None uses "
                                                    "learner.clip_eps.")
    tis_cap: float = Field(2.0, gt=0, le=1e4,
                           description="Truncation C of importance weights (tis, decoupled_ppo): "
                                       "min(w, C).")
    kl_coef: float = Field(0.0, ge=0, le=1e3,
                           description="β of the KL to the frozen reference model; 0 loads no "
                                       "reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL(π‖π_ref) estimator per token: k1 = log r, k2 = ½(log r)², "
                          "k3 = 1/r − 1 + log r with r = π/π_ref.")
    kl_in_reward: bool = Field(False, description="Subtract β·KL from the reward (as a return-"
                                                  "to-go added to the advantage) instead of "
                                                  "adding it to the loss.")
    drop_equal_reward_groups: bool = Field(False, description="DAPO dynamic sampling: drop "
                                                              "groups whose rewards are all "
                                                              "equal (zero advantage).")
    drop_finish_reasons: list[str] = Field(
        default_factory=list, description="Mask out the loss of samples with these finish "
                                          "reasons, e.g. [\"length\"] (overlong filtering); a "
                                          "group left with no trained token is dropped.")
    mismatch_warn_abs_logp: float = Field(0.5, gt=0, le=1e3,
                                          description="Warn when the mean |logp_train − "
                                                      "logp_rollout| passes this.")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig,
                                         description="Rollout correction: IS weights and "
                                                     "rejection masks (off by default).")
    entropy_coeff: float = Field(0.0, ge=0, le=10,
                                 description="Entropy bonus (verl's entropy_coeff): the loss "
                                             "subtracts entropy_coeff × the token entropy, "
                                             "aggregated like the policy loss; 0 is off.")

    @model_validator(mode="after")
    def _check_step_advantage(self) -> LossConfig:
        if self.step_advantage == "per_step" and self.advantage not in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"learner.loss.step_advantage = 'per_step' needs advantage grpo, "
                             f"dr_grpo or rloo (got {self.advantage!r})")
        if self.correction.is_level != "none" and self.policy_loss in ("ppo_clip", "tis",
                                                                         "gspo"):
            raise ValueError(f"learner.loss.correction.is_level = "
                             f"{self.correction.is_level!r} needs policy_loss reinforce or "
                             f"decoupled_ppo: {self.policy_loss}'s ratio is taken against the "
                             f"rollout policy already, a weight would count the gap twice")
        reasons = self.drop_finish_reasons
        if any(not r.strip() for r in reasons) or len(set(reasons)) != len(reasons):
            raise ValueError(f"learner.loss.drop_finish_reasons must be distinct, non-blank "
                             f"finish reasons (e.g. [\"length\"]), got {reasons}")
        return self


class LearnerConfig(Section):
    backend: Literal["fsdp2", "deepspeed", "sim"] = Field(
        "fsdp2", description="Training backend: torch FSDP2, DeepSpeed ZeRO (optional "
        "dependency; stage from zero_stage), or `sim`: a wait proportional to the trained "
        "tokens instead of compute (see [sim]).")
    zero_stage: Literal[2, 3] = Field(
        2, description="DeepSpeed only: ZeRO-2 shards optimizer state and gradients; ZeRO-3 "
        "also shards the weights (less memory, more communication).")
    ranks: int = Field(1, ge=1, le=MAX_PROCESSES,
                       description="Training ranks on this node (torchrun's --nproc-per-node; CLI "
                                   "--nproc-per-node).")
    nnodes: int = Field(1, ge=1, le=MAX_PROCESSES,
                        description="Learner nodes (CLI --nnodes); world size = nnodes x ranks, "
                                    "node K runs global ranks K*ranks .. K*ranks+ranks-1.")
    node_rank: int = Field(0, ge=0, description="This node's index (CLI --node-rank); node 0 "
                           "holds global rank 0, which reads the buffer and publishes weights.")
    master_addr: Host = Field("127.0.0.1", description="Host of global rank 0's "
                             "rendezvous (CLI --master-addr); reachable from every node.")
    groups_per_step: int = Field(32, ge=1, le=MAX_GROUPS,
                                 description="Groups consumed per optimizer step.")
    total_steps: int = Field(200, ge=1, le=MAX_STEPS,
                             description="Optimizer steps before the run ends.")
    lr: float = Field(1e-3, gt=0, lt=1, description="AdamW peak learning rate (1 or more diverges "
                                                   "at once: the loss turns NaN).")
    lr_warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Optimizer steps of linear "
                                 "warmup from lr/lr_warmup_steps up to lr (0 = none).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="After warmup: constant lr, or a cosine or linear decay to "
        "lr·lr_min_ratio at total_steps (learners/lr_schedule.py).")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="cosine, linear: the final "
                                "learning rate as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Max global grad norm.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range.")
    advantage_std_norm: bool = Field(True, description="GRPO: divide by the group's std.")
    loss: LossConfig = Field(default_factory=LossConfig,
                             description="Policy loss, advantages, aggregation, KL, filters.")
    threads: int = Field(1, ge=1, le=MAX_THREADS, description="torch threads per rank.")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="cuda uses NCCL.")
    master_port: int = Field(0, ge=0, le=65535, description="torch.distributed port (CLI "
                             "--master-port); 0 = a free one, single node only.")
    collective_timeout_s: Seconds = Field(
        300.0, gt=0, description="How long a rank waits in a collective of the learners' group "
        "before the run fails: a crashed peer process is noticed at once, a silent host or a "
        "hung NCCL peer only after this. Must exceed the longest time rank 0 spends between "
        "steps while the others wait (the eval every eval.every_steps, a checkpoint export).")
    micro_batch_tokens: int = Field(16384, ge=0, le=1 << 30,
                                    description="Tokens per forward/backward; a rank's share runs "
                                                "as micro-batches with gradient accumulation (0 = "
                                                "one micro-batch). Padding counts unless packing.")
    packing: bool = Field(False, description="Pack a micro-batch's sequences into one row "
                          "(positions restart per sequence, no attention across them) instead "
                          "of padding rows. Pays with a varlen kernel (model.attn_implementation"
                          " auto: flash_attention_2 or varlen_sdpa); with sdpa's dense block "
                          "mask it is slower than padding (bench/RESULTS.md).")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="FSDP2 parameter dtype for compute (gradients reduce and the "
        "optimizer steps in fp32): auto = bf16 on CUDA, fp32 on CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer's "
                                           "activations in backward: less memory, ~1/3 more "
                                           "compute.")
    compile: bool = Field(False, description="torch.compile each decoder layer (dynamic "
                          "shapes: micro-batch lengths do not recompile; perf/compiles counts "
                          "the graphs compiled in a step).")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="learner.compile's torch.compile backend; aot_eager and eager "
        "skip code generation (debugging, quick tests).")
    offload: Literal["none", "optimizer", "params"] = Field(
        "none", description="FSDP2: \"optimizer\" keeps AdamW's moments in host memory (one "
        "parameter's on the GPU at a time, in the step); \"params\" also the sharded weights "
        "and gradients (CPUOffloadPolicy; the optimizer steps on the CPU). Larger models "
        "train, slower.")
    liger: bool = Field(False, description="Liger's Triton kernels for RMSNorm, SwiGLU and "
                        "RoPE (CUDA; the liger-kernel package, in the gpu extra; refused "
                        "without it).")
    logprob_chunk_tokens: int = Field(
        1024, ge=0, le=1 << 20, description="Tokens per chunk through the LM head when "
        "computing logprobs and entropy (learner, reference, proximal): the [tokens, vocab] "
        "logits never exist whole; 0 = the full logits at once.")
    peak_tflops: float | None = Field(
        None, gt=0, description="The learner device's dense bf16 peak, TFLOP/s, for perf/mfu; "
        "unset: by the GPU's name (H100/H200 989, A100 312, ...: learners/flops.py), and no "
        "MFU on a CPU or a GPU not in that list.")
    routing_replay: bool = Field(False, description="MoE models: the engine records the "
                                 "experts it routed each token to, they travel with the group, "
                                 "and the learner's forward uses them instead of its own "
                                 "router's choice (the router still trains on its logits). "
                                 "Needs an engine that records them: rollout.engine = "
                                 "\"torch\", or vLLM's on a GPU.")


def _true_false_or_auto(value: Any) -> Any:
    """One error for a value that is none of them (a union reports one line per member)."""
    if value is True or value is False or value == "auto":
        return value
    raise ValueError('must be true, false or "auto"')


class WeightsConfig(Section):
    transport: Literal["auto", "gloo", "nccl", "ipc", "sim"] = Field(
        "auto", description="Learner → engine transport. auto: per membership epoch, ipc when "
                            "the learner and every engine share one GPU, nccl when all are on "
                            "other GPUs, gloo otherwise (CPU); nccl and ipc need CUDA and "
                            "learner.device = cuda; `sim` replaces each broadcast by a wait of "
                            "sim.sync_s in total (the handshake, announcements and acks stay "
                            "real).")
    overlap: bool = Field(True, description="Deliver each version to the engines (and publish "
                                            "it) on a thread while the learner goes on to the "
                                            "next step; false: sync before the next step.")
    bucket_mb: float = Field(32.0, gt=0, le=MAX_BUCKET_MB,
                             description="Broadcast bucket size (MB).")
    alone_mb: float = Field(1.0, ge=0, le=MAX_BUCKET_MB,
                            description="Tensors at least this big (MB) are broadcast from their "
                                        "own memory, one collective each, instead of being copied "
                                        "into a bucket; 0 packs every tensor (always 0 for sglang "
                                        "peers: one HTTP request per bucket).")
    timeout_s: Seconds = Field(60.0, gt=0, description="Per-collective timeout (a watchdog aborts "
                                                      "a group past it); evicts engines.")
    fanout: Annotated[bool | Literal["auto"], BeforeValidator(_true_false_or_auto)] = Field(
        "auto", description="Every learner rank sends each version to a slice of the engines "
                            "(send bandwidth grows with the ranks) instead of rank 0 to all. "
                            "Costs every rank a copy of the full weights in host memory "
                            "(two while a delivery overlaps a step), not rank 0 alone. auto: on "
                            "with several learner ranks, unless the engines get LoRA adapters "
                            "alone; true: on (an error where it cannot be); false: rank 0 "
                            "sends.")
    host: Host = Field("127.0.0.1",
                       description="Address each side of the broadcast binds and announces "
                                  "(learner rank 0's store, every engine's gloo device). "
                                  "Roles on several machines: \"auto\" (the address of the "
                                  "interface that reaches the buffer) or an explicit one.")


class SimConfig(Section):
    """Simulated compute (``rollout.engine``, ``learner.backend``, ``weights.transport`` =
    "sim"): the real worker, buffer, gate, learner loop and weight-sync protocol run, and only
    the model's arithmetic becomes calibrated waits. This measures the system's own overhead at
    a scale these machines cannot compute (bench/pipeline.py)."""

    decode_step_s: Seconds = Field(0.002, gt=0, description="Seconds per decode step of one "
                                                          "sequence running alone.")
    batch_slowdown: float = Field(0.0, ge=0, le=1e3,
                                  description="Batching effect: a decode step with `a` active "
                                              "sequences takes decode_step_s·(1 + "
                                              "batch_slowdown·(a−1)/max_batch).")
    max_batch: int = Field(256, ge=1, le=MAX_GROUPS,
                           description="Sequences an engine decodes at full slowdown.")
    prefill_s: Seconds = Field(0.0, ge=0, description="Fixed time before the first token.")
    length: Literal["fixed", "uniform", "lognormal"] = Field(
        "lognormal", description="Response-length distribution: fixed (= mean_tokens), "
                                 "uniform on [1, 2·mean_tokens − 1], or lognormal with `sigma` "
                                 "(a long tail like reasoning traces); all capped at "
                                 "rollout.max_new_tokens (capped responses finish by length).")
    mean_tokens: float = Field(64.0, ge=1, le=MAX_TOKENS,
                               description="Mean response length (before the cap).")
    sigma: float = Field(1.0, gt=0, le=10,
                         description="lognormal: σ of log length (1.0 ≈ long tail).")
    train_token_s: Seconds = Field(1e-5, ge=0, description="Learner seconds per trained token, for "
                                                         "all ranks together (a rank waits for "
                                                         "its share times the world size).")
    model_params: float = Field(7e9, ge=1, le=1e14, description="Parameters of the simulated model "
                                                       "(sync time = bytes / bandwidth).")
    param_bytes: int = Field(2, ge=1, le=8,
                             description="Bytes per parameter on the wire (bf16 = 2).")
    sync_gb_per_s: float = Field(50.0, gt=0, le=1e6, description="Broadcast bandwidth, GB/s.")

    @property
    def sync_s(self) -> float:
        """Seconds one weight broadcast takes on the wire."""
        return self.model_params * self.param_bytes / (self.sync_gb_per_s * 1e9)


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0, le=MAX_STEPS,
                             description="Greedy held-out eval period; 0 = end only.")
    stop_at_accuracy: float | None = Field(None, gt=0, le=1,
                                           description="End the run once eval reaches this.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "cpu", description="Where learner rank 0 runs the greedy eval (a torch engine; also "
                           "`asyncrl eval`): cpu keeps the GPUs for training; cuda for real "
                           "models, on rank 0's GPU.")


RAY_ADDRESS = r"^$|^auto$|^local$|^(ray://)?[^\s/:]+:[0-9]{1,5}$"
"""``launcher.address``: empty, ``auto``, ``local``, ``host:port`` or ``ray://host:port``."""


class LauncherConfig(Section):
    """How `asyncrl up` starts the roles and keeps the rollout fleet (and broker) alive."""

    type: Literal["local", "ray"] = Field(
        "local", description="Where `asyncrl up` starts roles: local OS processes, or actors on "
                             "a Ray cluster (placement groups sized by `resources`).")
    address: str = Field("", pattern=RAY_ADDRESS,
                         description="ray: cluster to join (`ray start --head` prints it, e.g. "
                                     "127.0.0.1:6379); empty starts a private local one.")
    stop_timeout_s: Seconds = Field(10.0, gt=0, description="SIGTERM → SIGKILL grace period.")
    learner_stop_timeout_s: Seconds = Field(
        120.0, gt=0, description="The learner's grace period after a stop: time to finish its "
                                 "step and save its checkpoint and export (a second Ctrl-C "
                                 "ends it at once).")
    refresh_s: Seconds = Field(2.0, ge=0.1, description="Progress line period of `asyncrl up`.")
    max_restarts: int = Field(3, ge=0, le=100,
                              description="Restarts of one crashed rollout worker (or ZMQ broker) "
                                          "before the run is stopped; a worker that ran "
                                          "`healthy_after_s` is forgiven its earlier crashes.")
    restart_backoff_s: Seconds = Field(1.0, ge=0, description="Wait before the first restart; "
                                                            "doubled after each further one "
                                                            "(the last at most a week).")
    healthy_after_s: Seconds = Field(60.0, gt=0, description="A process that ran this long before "
                                                           "crashing starts a fresh restart count.")
    colocate: bool = Field(False, description="Hybrid mode: learner ranks and engines share "
                           "the devices, time-sliced. Engines sleep (free their KV cache, weights "
                           "to host) while the learner steps; the learner moves its parameters, "
                           "gradients and optimizer state to host while engines generate. Needs "
                           "an engine that can sleep (rollout.engine = 'torch', 'vllm', "
                           "'vllm-server' or 'sglang'; vLLM's sleep frees memory on GPUs only) "
                           "and learner.backend = 'fsdp2'.")

    def stop_grace_s(self, role: str) -> float:
        """How long ``role`` gets after a stop before it is killed: the learner saves."""
        return self.learner_stop_timeout_s if role == "learner" else self.stop_timeout_s


class RoleResources(Section):
    """What one process of a role asks the cluster for (Ray placement-group bundles)."""

    cpus: float = Field(1.0, ge=0, le=1024, description="CPUs per process.")
    gpus: float = Field(0.0, ge=0, le=64, description="GPUs per process.")


class ResourcesConfig(Section):
    """Resource pools per role: one bundle per learner rank and per rollout worker."""

    learner: RoleResources = Field(default_factory=RoleResources,
                                   description="Per learner rank.")
    rollout: RoleResources = Field(default_factory=RoleResources,
                                   description="Per rollout worker.")
    buffer: RoleResources = Field(default_factory=lambda: RoleResources(cpus=0.5),
                                  description="The ZMQ broker.")


class MonitorConfig(Section):
    """What every role exposes for watching a run: metric sinks and Prometheus endpoints."""

    prometheus_port: int = Field(
        0, ge=0, le=65535 - 1024,
        description="Base port of the Prometheus /metrics endpoints on 127.0.0.1 (0 = off): the "
                    "buffer serves base + 0, the learner base + 1, rollout worker i base + 2 + i.")
    prometheus_host: Host = Field("127.0.0.1",
                                  description="Address the /metrics endpoints bind.")
    sinks: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where the learner writes its per-step metrics: jsonl (<run dir>/"
                    "metrics.jsonl, read by `asyncrl plot`), tensorboard (<run dir>/tensorboard; "
                    "needs the tensorboard package), wandb (needs the wandb package).")
    wandb_project: str = Field("asyncrl", pattern=r"^[^\s/\\#?%:\x00-\x1f]+$",
                               description="wandb project name (no spaces, no /\\#?%:).")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="wandb mode; offline writes <run dir>/wandb for `wandb sync`.")
    tui: Literal["auto", "rich", "plain"] = Field(
        "auto", description="Live view of `asyncrl up`/`monitor`: rich (a full-screen table), "
                            "plain (progress lines), auto (rich when stdout is a terminal).")
    history: int = Field(120, ge=2, le=100_000,
                         description="Learner steps kept for the sparklines.")

    @model_validator(mode="after")
    def _check_sinks(self) -> MonitorConfig:
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"monitor.sinks lists a sink twice: {self.sinks}")
        return self


class CheckpointConfig(Section):
    """Learner checkpoints (sharded model and optimizer: torch DCP for FSDP2, DeepSpeed's own for
    DeepSpeed; version, RNG, counters) and HF exports."""

    every_steps: int = Field(50, ge=0, le=MAX_STEPS,
                             description="Checkpoint period in optimizer steps; 0 = only at the "
                                         "end or on stop.")
    keep: int = Field(2, ge=1, le=1000,
                      description="Most recent checkpoints kept; older ones are deleted.")
    resume: bool = Field(True, description="Resume from the latest checkpoint in `dir` if one "
                                           "exists (a learner restart or `asyncrl up` again).")
    path: Name = Field("", description="Resume from this checkpoint directory (`--resume PATH`); "
                                      "empty: the latest in `dir` when `resume` is true.")
    hf_every_steps: int = Field(0, ge=0, le=MAX_STEPS,
                                description="Export an HF model to <run dir>/hf/step_<V> every "
                                            "this many steps; 0 = off.")
    dir: Name = Field("checkpoints", min_length=1,
                     description="Checkpoint directory, relative to the run directory.")


class Config(Section):
    """The root config: everything a run needs, read from one TOML file."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    reward: RewardConfig = RewardConfig()
    data: DataConfig = DataConfig()
    workflow: WorkflowConfig = WorkflowConfig()
    buffer: BufferConfig = BufferConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    eval: EvalConfig = EvalConfig()
    launcher: LauncherConfig = LauncherConfig()
    resources: ResourcesConfig = ResourcesConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    monitor: MonitorConfig = MonitorConfig()
    sim: SimConfig = SimConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        """The rules across sections (:mod:`asyncrl.config.checks`), all reported at once."""
        problems = consistency_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def run_dir(self) -> Path:
        return self.run.output_dir / self.run.name
