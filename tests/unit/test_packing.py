"""Token balancing across ranks, micro-batch plans, and the packed forward pass."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from asyncrl.wire import TrajectoryGroup
from learners.balance import _WIRE, partition_by_tokens, split_batch
from learners.batching import ROW_FIELDS, TrainBatch, collate
from learners.packing import micro_batches, pack, plan_micro_batches, token_logprobs

torch.set_num_threads(1)
VOCAB = 16


def make_groups(lengths: list[list[int]], seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of samples with the given total lengths (prompt 2 tokens, the rest generated)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, group_lengths in enumerate(lengths):
        samples = []
        for n in group_lengths:
            gen = n - 2
            samples.append({
                "tokens": rng.integers(0, VOCAB, n), "reward": float(rng.random()),
                "logprobs": np.r_[np.zeros(2), rng.normal(-2.0, 0.3, gen)],
                "loss_mask": np.r_[np.zeros(2), np.ones(gen)],
                "versions": np.r_[-np.ones(2), np.zeros(gen)], "finish_reason": "stop"})
        groups.append(TrajectoryGroup.from_samples(f"g{g}", f"p{g}", samples))
    return groups


# --- partition_by_tokens ------------------------------------------------------------------------

def test_partition_literal() -> None:
    # LPT: 9→p0, 8→p1, 5→p1 (13), 4→p0 (13), 3→p0 (16)... loads 16 / 13+... see below
    parts = partition_by_tokens([9, 8, 5, 4, 3, 1], 2)
    # 9→A(9) 8→B(8) 5→B(13) 4→A(13) 3→A(16) 1→B(14): A = {0,3,4}, B = {1,2,5}
    assert parts == [[0, 3, 4], [1, 2, 5]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_partition_covers_and_balances(seed: int, parts: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, 40).tolist()
    out = partition_by_tokens(lengths, parts)
    assert sorted(i for part in out for i in part) == list(range(40))   # each index exactly once
    loads = [sum(lengths[i] for i in part) for part in out]
    # LPT bound: the heaviest part exceeds the mean by at most the longest item.
    assert max(loads) - sum(lengths) / parts <= max(lengths)
    assert max(loads) - min(loads) <= max(lengths)


def test_partition_fewer_items_than_parts() -> None:
    assert partition_by_tokens([5, 7], 3) == [[1], [0], []]


def test_split_batch_pads_empty_shares() -> None:
    batch = collate(make_groups([[5, 9]]), std_norm=True, pad_id=0)
    shares = split_batch(batch, 3)
    assert [s.num_samples for s in shares] == [1, 1, 1]
    assert shares[2].sample_mask.tolist() == [False]
    assert shares[2].num_tokens == 0 and shares[2].advantages.abs().sum() == 0
    assert sum(s.num_tokens for s in shares) == batch.num_tokens


def test_split_keeps_whole_batch_group_tokens() -> None:
    # One group of 3 samples split over 2 ranks: group_tokens still counts the whole group.
    batch = collate(make_groups([[6, 5, 4]]), std_norm=True, pad_id=0)
    total = float(batch.loss_mask.sum())
    for share in split_batch(batch, 2):
        assert share.group_tokens.tolist() == [total] * share.num_samples
        assert share.input_ids.shape[1] == int(share.lengths.max())   # trimmed to its longest


def test_wire_table_names_every_field() -> None:
    """Every field but ``routing``, which the scatter lays out last, and only when the batch
    carries it (``learners.balance._layout``), and a VLM's pixels and grids, laid out only
    when a share has images."""
    assert set(_WIRE) | {"routing", *ROW_FIELDS} == {f.name for f in fields(TrainBatch)}


# --- plan_micro_batches ---------------------------------------------------------------------------

def test_plan_packed_first_fit_decreasing() -> None:
    # 7→[7] 5→[7]? no (12>10) → new [5] 4→[5,4] 3→[7,3] 2→ [5,4]? 11>10 → new [2]
    assert plan_micro_batches([5, 7, 3, 4, 2], 10, packing=True) == [[1, 2], [0, 3], [4]]


def test_plan_padded_counts_padding() -> None:
    # longest first: [7] (2×7 > 10 with 5), [5] (2×5 ≤ 10 with 4) → [5,4], [3,2] (3×3 ≤ 10? adds 2)
    assert plan_micro_batches([5, 7, 3, 4, 2], 10, packing=False) == [[1], [0, 3], [2, 4]]


def test_plan_oversized_and_unlimited() -> None:
    assert plan_micro_batches([30, 2], 10, packing=True) == [[0], [1]]
    assert plan_micro_batches([30, 2, 9], 0, packing=True) == [[0, 1, 2]]


@pytest.mark.parametrize("packing", [True, False])
def test_plan_respects_budget(packing: bool) -> None:
    lengths = np.random.default_rng(1).integers(1, 60, 50).tolist()
    plan = plan_micro_batches(lengths, 128, packing)
    assert sorted(i for mb in plan for i in mb) == list(range(50))
    for mb in plan:
        cost = sum(lengths[i] for i in mb) if packing else len(mb) * max(lengths[i] for i in mb)
        assert cost <= 128


def test_micro_batches_pad_to_count() -> None:
    batch = collate(make_groups([[5, 6], [7]]), std_norm=True, pad_id=0)
    mbs = micro_batches(batch, 12, packing=True, count=4)
    assert len(mbs) == 4
    assert sum(mb.num_tokens for mb in mbs) == batch.num_tokens
    assert mbs[-1].sample_mask.tolist() == [False]


# --- packed forward -------------------------------------------------------------------------------

def test_pack_layout() -> None:
    batch = collate(make_groups([[3, 5], [2]]), std_norm=True, pad_id=0)
    input_ids, position_ids, (rows, cols) = pack(batch)
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert input_ids[0, 3:8].tolist() == batch.input_ids[1, :5].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_padded(attn: str) -> None:
    """No attention across packed sequences: each sequence's logprobs (and gradients) are those
    of its padded row, for both CPU attention implementations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation=attn)
    model = Qwen2ForCausalLM(config).eval()
    batch = collate(make_groups([[9, 4, 12], [3, 7]]), std_norm=True, pad_id=0)
    padded = token_logprobs(model, batch, packing=False)
    (padded * batch.loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packed = token_logprobs(model, batch, packing=True)
    (packed * batch.loss_mask).sum().backward()
    real = batch.attention_mask.bool()
    torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=0)
    assert packed[~real].abs().sum() == 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4)
