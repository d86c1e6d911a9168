"""The config schema. Every field says what it means; validation is local to its component.

Cross-component checks (``learner.groups_per_step`` divisible by ``learner.ranks``) live in
:meth:`Config._check_consistency`, which only rejects, never rewrites a sibling section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, models are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RunConfig(Section):
    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: Path = Field(Path("runs"), description="Parent of run directories.")
    seed: int = Field(0, ge=0, description="Base seed; each role and rank derives its own.")


class TinyModelConfig(Section):
    """A random-init Qwen2-style model built in code (used when ``model.path`` is empty)."""

    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(256, ge=8)
    max_position_embeddings: int = Field(64, ge=8)


class ModelConfig(Section):
    path: str = Field("", description="HF model directory or hub id; empty builds `tiny` in code.")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")


class TaskConfig(Section):
    name: Literal["copy", "reverse", "sort"] = Field("copy", description="Built-in digit task.")
    length: int = Field(4, ge=1, le=32, description="Digits per prompt.")
    eval_size: int = Field(256, ge=1, description="Held-out prompts for greedy evaluation.")


class BufferConfig(Section):
    type: Literal["zmq", "redis"] = Field(
        "zmq", description="Buffer backend: embedded ZMQ broker, or Redis Streams (multi-node, "
                           "durable; Redis is then the broker and `asyncrl buffer` is not needed).")
    host: str = Field("127.0.0.1", description="Address the ZMQ broker binds and clients dial.")
    port: int = Field(5555, ge=0, le=65535, description="ZMQ broker port; 0 picks a free one.")
    url: str = Field("redis://127.0.0.1:6379/0",
                     description="Redis URL (redis:// or rediss:// for TLS), buffer.type=redis.")
    namespace: str = Field("", description="Redis key prefix; empty uses asyncrl:<run.name>.")
    username: str = Field("", description="Redis ACL user (empty: default user).")
    password: str = Field("", description="Redis password (or ACL user's password).")
    tls_ca_file: str = Field("", description="CA bundle to verify the Redis server (TLS).")
    tls_cert_file: str = Field("", description="Client certificate for Redis mutual TLS.")
    tls_key_file: str = Field("", description="Client key for Redis mutual TLS.")
    auth: Literal["none", "curve"] = Field("none", description="ZMQ authentication: CURVE keys.")
    curve_keys_dir: str = Field("", description="Directory with the ZMQ CURVE key pairs.")
    max_staleness: int = Field(2, ge=0, description="s: never train on a sample staler than s.")
    max_groups: int = Field(4096, ge=1, description="Most groups held before producers wait.")
    max_message_bytes: int = Field(64 << 20, ge=1024,
                                   description="Larger trajectory groups are rejected.")
    reclaim_idle_s: float = Field(60.0, gt=0,
                                  description="Groups delivered but not acked for this long (a "
                                              "dead learner) are redelivered.")
    spill_path: str = Field("", description="ZMQ: append-only file so a broker restart loses "
                                            "nothing accepted and unacked (empty: memory only).")
    heartbeat_timeout_s: float = Field(15.0, gt=0,
                                       description="A silent rollout worker's in-flight groups "
                                                   "are released after this long.")
    request_timeout_s: float = Field(30.0, gt=0, description="Client-side request timeout.")


class RolloutConfig(Section):
    engine: Literal["torch", "vllm", "vllm-server"] = Field(
        "torch", description="Inference engine: pure-torch reference, in-process vLLM, or an "
                             "external vLLM OpenAI server fleet at `url` (attached, not started).")
    url: str = Field("", description="vllm-server: base URL(s) of the server(s), comma-"
                                     "separated; worker i attaches to entry i mod len.")
    kv_cache_memory_mb: int = Field(64, ge=0, description="vllm: KV cache size (MB); 0 sizes it "
                                                          "from gpu_memory_utilization.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1,
                                          description="vllm on GPU: fraction of the device's "
                                                      "memory the engine may take.")
    enforce_eager: bool = Field(True, description="vllm: no CUDA graphs / torch.compile (fast "
                                                  "start; turn off for long GPU runs).")
    request_timeout_s: float = Field(120.0, gt=0, description="vllm-server: HTTP timeout.")
    workers: int = Field(2, ge=1, description="Rollout worker processes (one engine each).")
    group_size: int = Field(16, ge=1, description="Samples per prompt (G).")
    groups_per_batch: int = Field(8, ge=1, description="Groups generated in one engine call.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    max_new_tokens: int = Field(8, ge=1, description="Generation length limit.")
    threads: int = Field(1, ge=1, description="torch threads per worker.")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="Engine device.")

    @model_validator(mode="after")
    def _check_server_url(self) -> RolloutConfig:
        if self.engine == "vllm-server" and not self.url.strip():
            raise ValueError("rollout.engine = 'vllm-server' needs rollout.url (the server fleet)")
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
    gae_gamma: float = Field(1.0, gt=0, le=1, description="GAE discount γ per token.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE λ: 0 trusts the critic, 1 is "
                                                            "Monte-Carlo.")
    critic_lr: float | None = Field(None, gt=0, description="Critic AdamW lr; None uses "
                                                            "learner.lr.")
    aggregation: Literal["token", "sequence", "group"] = Field(
        "token", description="token: mean over all trained tokens; sequence: mean over "
                             "samples of each sample's token mean; group: mean over groups of "
                             "each group's token mean.")
    clip_eps_high: float | None = Field(
        None, gt=0, description="Upper clip 1 + clip_eps_high (DAPO clip-higher, e.g. 0.28); "
                                "None uses learner.clip_eps.")
    tis_cap: float = Field(2.0, gt=0, description="Truncation C of importance weights (tis, "
                                                  "decoupled_ppo): min(w, C).")
    kl_coef: float = Field(0.0, ge=0, description="β of the KL to the frozen reference model; "
                                                  "0 loads no reference model.")
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
    mismatch_warn_abs_logp: float = Field(
        0.5, gt=0, description="Warn when the mean |logp_train − logp_rollout| passes this.")


class LearnerConfig(Section):
    backend: Literal["fsdp2", "deepspeed"] = Field(
        "fsdp2", description="Training backend: torch FSDP2, or DeepSpeed ZeRO (optional "
        "dependency; stage from zero_stage).")
    zero_stage: Literal[2, 3] = Field(
        2, description="DeepSpeed only: ZeRO-2 shards optimizer state and gradients; ZeRO-3 "
        "also shards the weights (less memory, more communication).")
    ranks: int = Field(1, ge=1, description="Training ranks on this node.")
    groups_per_step: int = Field(32, ge=1, description="Groups consumed per optimizer step.")
    total_steps: int = Field(200, ge=1, description="Optimizer steps before the run ends.")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range.")
    advantage_std_norm: bool = Field(True, description="GRPO: divide by the group's std.")
    loss: LossConfig = Field(default_factory=LossConfig,
                             description="Policy loss, advantages, aggregation, KL, filters.")
    threads: int = Field(1, ge=1, description="torch threads per rank.")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="cuda uses NCCL.")
    master_port: int = Field(0, ge=0, le=65535, description="torch.distributed port; 0 = free.")


class WeightsConfig(Section):
    transport: Literal["gloo"] = Field("gloo", description="Learner → engine broadcast backend.")
    bucket_mb: float = Field(32.0, gt=0, description="Broadcast bucket size (MB).")
    timeout_s: float = Field(60.0, gt=0, description="Per-collective timeout; evicts engines.")


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0, description="Greedy held-out eval period; 0 = end only.")
    stop_at_accuracy: float | None = Field(None, gt=0, le=1,
                                           description="End the run once eval reaches this.")


class LauncherConfig(Section):
    type: Literal["local"] = Field("local", description="Where `asyncrl up` starts roles.")
    stop_timeout_s: float = Field(10.0, gt=0, description="SIGTERM → SIGKILL grace period.")
    refresh_s: float = Field(2.0, gt=0, description="Progress line period of `asyncrl up`.")


class CheckpointConfig(Section):
    """Learner checkpoints (sharded DCP: model, optimizer, version, RNG) and HF exports."""

    every_steps: int = Field(50, ge=0, description="Checkpoint period in optimizer steps; 0 = "
                                                   "only at the end or on stop.")
    keep: int = Field(2, ge=1, description="Most recent checkpoints kept; older ones are deleted.")
    resume: bool = Field(True, description="Resume from the latest checkpoint in `dir` if one "
                                           "exists (a learner restart or `asyncrl up` again).")
    path: str = Field("", description="Resume from this checkpoint directory (`--resume PATH`); "
                                      "empty: the latest in `dir` when `resume` is true.")
    hf_every_steps: int = Field(0, ge=0, description="Export an HF model to <run dir>/hf/step_<V> "
                                                     "every this many steps; 0 = off.")
    dir: str = Field("checkpoints", min_length=1,
                     description="Checkpoint directory, relative to the run directory.")


class Config(Section):
    """The root config: everything a run needs, read from one TOML file."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    buffer: BufferConfig = BufferConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    eval: EvalConfig = EvalConfig()
    launcher: LauncherConfig = LauncherConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        if self.learner.backend == "deepspeed" and (self.checkpoint.every_steps
                                                    or self.checkpoint.resume):
            raise ValueError(
                "learner.backend = 'deepspeed' has no training checkpoints yet (they are "
                "sharded DCP of FSDP2 modules): set checkpoint.every_steps = 0 and "
                "checkpoint.resume = false, or use learner.backend = 'fsdp2'")
        if self.learner.groups_per_step % self.learner.ranks:
            raise ValueError(
                f"learner.groups_per_step ({self.learner.groups_per_step}) must be divisible by "
                f"learner.ranks ({self.learner.ranks}): each rank consumes an equal share")
        if self.task.length + 2 + self.rollout.max_new_tokens > \
                self.model.tiny.max_position_embeddings and not self.model.path:
            raise ValueError(
                "model.tiny.max_position_embeddings is shorter than prompt + "
                "rollout.max_new_tokens")
        return self

    @property
    def run_dir(self) -> Path:
        return self.run.output_dir / self.run.name
