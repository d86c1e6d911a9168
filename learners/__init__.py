"""Learners: batching, losses and training backends that consume trajectory groups.

Only light, torch-only modules are re-exported here; backends (which import transformers and
torch.distributed) are imported from ``learners.backends`` where they are needed.
"""

from learners.batching import TrainBatch, collate
from learners.losses import grpo_advantages, ppo_clip_loss

__all__ = ["TrainBatch", "collate", "grpo_advantages", "ppo_clip_loss"]
