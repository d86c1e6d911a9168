"""An engine's behaviour logprobs against the learner's recompute: the check every vLLM
engine module runs on the engine it has started (one copy of the arithmetic, so each compares
the same thing)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import TaskConfig
from asyncrl.models import PAD_ID, load_causal_lm
from rollouters.tasks import make_task


def learner_mismatch(engine: Any, model_dir: Path, seed: int, prompts: int = 4,
                     group_size: int = 8) -> tuple[torch.Tensor, Any]:
    """|learner - engine| per generated token at T=1 (8 tokens a row), from the learner's
    ``token_logprobs`` on the collated batch; and the batch."""
    from learners.backends.fsdp2 import token_logprobs
    from learners.batching import collate
    from rollouters.workflows.single_turn import generate_groups

    task = make_task(TaskConfig(), seed=0)
    groups = generate_groups(engine, task, task.sample(random.Random(seed), prompts),
                             group_size=group_size, temperature=1.0, max_new_tokens=8)
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    with torch.no_grad():
        learner = token_logprobs(load_causal_lm(model_dir), batch)
    return (learner - batch.behaviour_logprobs)[batch.loss_mask].abs(), batch
