"""A simulated training backend: the :class:`~learners.backends.base.Trainer` contract with a
wait in place of the forward/backward pass (``learner.backend = "sim"``).

Everything around the step stays real: the learner loop, batch collation, acks, the global
metrics (gathered in the step's one collective), the weight broadcast protocol and
checkpoints (the model is the run's tiny model, never updated, so the code paths that save
or send weights have real tensors to handle).

Timing: ``sim.train_token_s`` is the learner's seconds per trained token with all ranks
together. Data-parallel ranks finish together, so each rank waits for the *largest* share:
``max_r(tokens_r) · world · train_token_s``. An uneven split costs time, as it does on GPUs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config.schema import LearnerConfig, SimConfig
from learners.batching import TrainBatch
from learners.dist import gather_rows
from learners.export_dir import replace_dir
from learners.step_metrics import metric_row, reduce_metric_rows

logger = logging.getLogger(__name__)


class SimTrainer:
    """One learner rank whose optimizer step is a calibrated wait."""

    def __init__(self, model_path: str | Path, cfg: LearnerConfig, sim: SimConfig,
                 version: int = 0) -> None:
        from asyncrl.models import load_causal_lm

        self.cfg, self.sim = cfg, sim
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.version = version
        self.model = load_causal_lm(model_path, "float32", "cpu")
        self.model.requires_grad_(False)  # never trained: the weights only travel
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Wait for the slowest rank's share of the step; global metrics as a real backend's
        (``learners.step_metrics``, with a zero loss). COLLECTIVE: one all-gather, of the
        shares' token counts and the metric rows together. The metrics depend on the batch
        alone here (no loss), so they need not wait for the step: a second collective after
        the wait would cost the harness a meeting of 8 ranks on 2 cores (bench/pipeline.py:
        6-56 ms) that NCCL on a real cluster does in microseconds, and bias the measured
        pipeline against its bound."""
        start = time.perf_counter()
        tokens = batch.loss_mask.sum().to(torch.float32)
        stats = {"tokens": tokens}
        rows = gather_rows(torch.cat([tokens.reshape(1), metric_row(torch.zeros(()), stats,
                                                                    batch)]))
        largest = rows[:, 0].max()
        metrics = reduce_metric_rows(rows[:, 1:], tokens, stats)
        wait = float(largest) * self.world * self.sim.train_token_s - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        self.version += 1
        metrics["actor/lr"] = 0.0
        metrics["timing/train_step"] = time.perf_counter() - start
        return metrics

    def full_state_dict(self, every_rank: bool = False) -> dict[str, Tensor]:
        """Rank 0 (every rank with ``every_rank``): the (never updated) tiny model's weights;
        others: empty, as with FSDP2."""
        if self.rank != 0 and not every_rank:
            return {}
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def save_pretrained(self, path: str | Path,
                        state: dict[str, Tensor] | None = None) -> None:
        if self.rank == 0:
            replace_dir(path, lambda directory: self.model.save_pretrained(directory,
                                                                           state_dict=state))
        if self.world > 1:
            dist.barrier()
