"""The learner's offload for ``launcher.colocate`` (``learners.colocate.HostOffload``) over a
real FSDP2 trainer (one gloo rank here; two in the colocated run of
``tests/integration/test_colocate.py``): its parameters, gradients and optimizer state move out
(the tensors it held are let go) and back, and training goes on exactly as without the trip.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from learners.batching import collate
from tests.unit.test_fsdp2 import CFG, rank_groups, spawn_runs, tiny_model_dir  # noqa: F401

STEPS = 2


def _tensors(offload) -> list[torch.Tensor]:
    """Every tensor of the learner's state this rank holds: local shards, states."""
    params = [getattr(p, "_local_tensor", p) for m in offload.modules for p in m.parameters()]
    states = [getattr(v, "_local_tensor", v) for opt in offload.optimizers
              for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + states


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             offloaded: bool) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.colocate import trainer_offload

    trainer = Fsdp2Trainer(model_dir, CFG, device)
    offload = trainer_offload(trainer)
    batch = collate(rank_groups(rank, world), std_norm=CFG.advantage_std_norm, pad_id=0)
    metrics, released = [], []
    for _ in range(STEPS):
        metrics.append(trainer.train_step(batch))
        if offloaded:
            before = [t.clone() for t in _tensors(offload)]
            refs = [weakref.ref(t) for t in _tensors(offload)]
            offload.to_host()
            gc.collect()
            released.append(sum(r() is not None for r in refs))
            offload.to_device()
            after = _tensors(offload)
            assert len(after) == len(before)
            assert all(torch.equal(a, b) for a, b in zip(after, before))
            del after, before   # the check must not hold the tensors the next one watches
    torch.save({"metrics": metrics, "state": trainer.full_state_dict(), "released": released,
                "states": len(trainer.optimizer.state)}, Path(out_dir) / f"rank{rank}.pt")


def test_offload_and_back_changes_no_step(tiny_model_dir: Path,  # noqa: F811
                                          tmp_path: Path) -> None:
    runs = spawn_runs(run_rank, tiny_model_dir, tmp_path,
                      {"plain": (1, (False,)), "offloaded": (1, (True,))})
    for rank in range(1):
        plain = torch.load(runs["plain"] / f"rank{rank}.pt", weights_only=False)
        moved = torch.load(runs["offloaded"] / f"rank{rank}.pt", weights_only=False)
        assert moved["states"] > 0                       # AdamW state existed and travelled
        assert moved["released"] == [0] * STEPS          # no tensor of the old state is held
        assert [m["actor/loss"] for m in moved["metrics"]] == \
            [m["actor/loss"] for m in plain["metrics"]]
        assert [m["actor/grad_norm"] for m in moved["metrics"]] == \
            [m["actor/grad_norm"] for m in plain["metrics"]]
        for name, tensor in plain["state"].items():
            assert torch.equal(moved["state"][name], tensor), name


def test_the_loop_calls_both_kinds_of_phases_alike() -> None:
    """``Separate`` (not colocated) and ``Colocated`` are called by the loop the same way; a
    plain module's state goes out and back through them, the metrics named as recorded."""
    import inspect

    from learners.colocate import Colocated, HostOffload, Separate
    from learners.lost import Lost

    for name in ("train_phase", "rollout_phase", "end"):
        assert inspect.signature(getattr(Separate, name)) == \
            inspect.signature(getattr(Colocated, name)), name
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    phases = Colocated(HostOffload([model], [optimizer], torch.device("cpu")), None, 1)
    phases.start()
    held = [model.weight.data, optimizer.state[model.weight]["exp_avg"]]
    phases.train_phase(1, Lost())
    assert all(t.data_ptr() not in {h.data_ptr() for h in held}
               for t in (model.weight.data, optimizer.state[model.weight]["exp_avg"]))
    metrics = phases.rollout_phase(Lost())
    assert {"colocate/onload_s", "colocate/offload_s", "colocate/handover_s"} <= set(metrics)
    phases.end()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
