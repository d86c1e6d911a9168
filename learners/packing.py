"""Micro-batches by a token budget, and the packed forward pass.

A rank's share can be larger than one forward should hold (``learner.micro_batch_tokens``), so
the trainer runs it as micro-batches and accumulates gradients. Two layouts:

- **packed** (``learner.packing = true``): a micro-batch's sequences are concatenated into ONE
  row with ``position_ids`` restarting at 0 for each sequence and no 2-D attention mask. The
  forward also carries the sequences' offsets (``cu_seq_lens_*``, ``learners.attention``):
  the varlen kernels (``varlen_sdpa``, ``flash_attention_2``) attend within each sequence from
  them; with ``sdpa``/``eager``/``flex_attention`` transformers (5.x
  ``masking_utils.find_packed_sequence_indices``) builds a block-diagonal causal mask from
  the positions instead. Either way no token attends across sequences — but only without a
  KV cache (``use_cache=False``: with one, the detection is skipped and sequences silently
  attend to each other) (``tests/unit/test_packing.py``, ``tests/unit/test_attention.py``
  check the logprobs equal the padded ones). No padding is computed at all.
- **padded**: rows right-padded to the micro-batch's longest, the budget counting padding.

Either way the logprobs come back in the per-sequence ``[B, T]`` layout of
:class:`learners.batching.TrainBatch`, so every loss (GSPO's sequence ratio, KL-to-go, GAE) sees
one sequence per row, whatever the layout of the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from learners.attention import varlen_kwargs
from learners.batching import TrainBatch
from learners.fused_logprobs import HeadKernels, fusable, head_logprobs, plain_logprobs_entropy
from learners.lora import hf_model
from learners.vision import forward_inputs, refuse_packing


def plan_micro_batches(lengths: Sequence[int], budget: int, packing: bool) -> list[list[int]]:
    """Row indices of each micro-batch; ``budget`` = tokens per forward (0 = one micro-batch).

    Packed: first-fit decreasing into bins of ``budget`` tokens. Padded: rows sorted by length,
    longest first, added while ``rows × longest <= budget``. A sequence longer than the budget
    gets a micro-batch of its own (it cannot be split). Every row lands in exactly one
    micro-batch; indices within one are ascending.
    """
    rows = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if budget <= 0 or not rows:
        return [sorted(rows)] if rows else []
    bins: list[list[int]] = []
    if packing:
        loads: list[int] = []
        for i in rows:
            fit = next((b for b, load in enumerate(loads) if load + lengths[i] <= budget), None)
            if fit is None:
                bins.append([i])
                loads.append(int(lengths[i]))
            else:
                bins[fit].append(i)
                loads[fit] += int(lengths[i])
    else:
        for i in rows:   # longest first: a bin's first row sets its width
            if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
                bins[-1].append(i)
            else:
                bins.append([i])
    return [sorted(b) for b in bins]


def micro_batches(batch: TrainBatch, budget: int, packing: bool, count: int | None = None
                  ) -> list[TrainBatch]:
    """``batch`` cut by :func:`plan_micro_batches`, then padded with zero-weight micro-batches
    up to ``count`` (every rank must run the same number of forwards: FSDP's all-gathers)."""
    plan = plan_micro_batches(batch.lengths.tolist(), budget, packing)
    out = [batch.select(rows) for rows in plan]
    if count is not None:
        out += [batch.as_pad()] * (count - len(out))
    return out


def pack(batch: TrainBatch) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """``(input_ids [1, N], position_ids [1, N], (rows, cols))``: the rows concatenated without
    padding, positions restarting per sequence, and where each packed token sits in ``[B, T]``."""
    lengths = batch.lengths
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.sum()), device=lengths.device) - starts[rows]
    return batch.input_ids[rows, cols].unsqueeze(0), cols.unsqueeze(0), (rows, cols)


# The LM head runs on this many tokens at a time (``learner.logprob_chunk_tokens``'s default;
# 0 = the full logits at once): ``learners.fused_logprobs``.
LOGPROB_CHUNK_TOKENS = 1024


def token_logprobs(model: nn.Module, batch: TrainBatch, packing: bool = False,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, temperature: float = 1.0,
                   head_kernels: HeadKernels | None = None, positions: Tensor | None = None
                   ) -> Tensor:
    """``log p(targets[b, t] | input_ids[b, ≤t])`` as float32 ``[B, T]`` (0 on padding when
    packed, and outside ``positions`` when given: :func:`token_logprobs_and_entropy`), by a
    packed or a padded forward (see the module docstring), of the logits divided by
    ``temperature``: the distribution the engines sampled from (``rollout.temperature``),
    whose logprobs they report as the behaviour's."""
    return token_logprobs_and_entropy(model, batch, packing, entropy=False,
                                      chunk_tokens=chunk_tokens, temperature=temperature,
                                      head_kernels=head_kernels, positions=positions)[0]


def token_logprobs_and_entropy(model: nn.Module, batch: TrainBatch, packing: bool = False,
                               entropy: bool = True, entropy_grad: bool = False, *,
                               chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                               temperature: float = 1.0, head_kernels: HeadKernels | None = None,
                               positions: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs` and, from the same forward, the per-token entropy (float32,
    detached unless ``entropy_grad``: an entropy bonus differentiates it).

    ``positions`` (bool ``[B, T]``, the learner's loss mask): the only tokens whose logprob and
    entropy are wanted; both are 0 elsewhere, and the fused head never computes them (a
    prompt's tokens, padding, an environment's turns: their share of the LM head's work).

    ``chunk_tokens > 0`` and a :func:`~learners.fused_logprobs.fusable` model: the LM head runs
    that many tokens at a time and the ``[tokens, vocab]`` logits never exist whole
    (``learners.fused_logprobs``), its per-chunk arithmetic by ``head_kernels`` (compiled
    under ``learner.compile``; default eager); otherwise the full logits (the plain path,
    which the fused one equals within float rounding: ``tests/unit/test_fused_logprobs.py``)."""
    refuse_packing(packing, batch.pixel_values)
    if packing:
        input_ids, position_ids, (rows, cols) = pack(batch)
        # use_cache=False is REQUIRED: with a cache (the default in eval mode) transformers
        # skips the packed-sequence detection and every token attends across sequences.
        # The sequence boundaries, for varlen kernels (learners.attention); others ignore them.
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False,
                  **varlen_kwargs(batch.lengths)}
        targets = batch.targets[rows, cols].unsqueeze(0)
        where = None if positions is None else positions[rows, cols].unsqueeze(0)
    else:
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  "use_cache": False}
        targets = batch.targets
        where = positions
    context: AbstractContextManager = nullcontext()
    if batch.pixel_values is not None:   # a vision-language model (learners.vision)
        vision, context = forward_inputs(model, batch)
        inputs.update(vision)
    with context:
        logprobs, ent = _forward_logprobs(model, targets, chunk_tokens, inputs,
                                          entropy and entropy_grad, temperature, head_kernels,
                                          where)
    if not (entropy and entropy_grad):
        ent = ent.detach()
    if packing:
        logprobs = _unpack(logprobs[0], batch, rows, cols)
        ent = _unpack(ent[0], batch, rows, cols)
    return logprobs, ent if entropy else None


def fuses_head(model: nn.Module, chunk_tokens: int) -> bool:
    """Whether :func:`token_logprobs_and_entropy` takes ``model``'s fused, chunked head (which
    runs on the wanted ``positions`` alone) rather than its full logits."""
    return chunk_tokens > 0 and fusable(hf_model(model))


def _forward_logprobs(model: nn.Module, targets: Tensor, chunk_tokens: int,
                      inputs: dict[str, Any], entropy_grad: bool, temperature: float,
                      head_kernels: HeadKernels | None, where: Tensor | None
                      ) -> tuple[Tensor, Tensor]:
    """Per-token ``(logprob, entropy)`` of ``targets`` from one forward of ``model``, of the
    logits divided by ``temperature``; 0 outside ``where`` (shaped like ``targets``) if given."""
    if fuses_head(model, chunk_tokens):
        return head_logprobs(model, hf_model(model).get_output_embeddings(), targets,
                             chunk_tokens, temperature, head_kernels, where, **inputs)
    logits = model(**inputs).logits
    if temperature != 1.0:
        logits = logits.float() / temperature
    logprobs, entropy = plain_logprobs_entropy(logits, targets, entropy_grad)
    if where is None:
        return logprobs, entropy
    return logprobs.where(where, 0.0), entropy.where(where, 0.0)


def _unpack(packed: Tensor, batch: TrainBatch, rows: Tensor, cols: Tensor) -> Tensor:
    """Packed ``[N]`` values back into the ``[B, T]`` rows (0 on padding); differentiable."""
    out = torch.zeros(batch.input_ids.shape, dtype=packed.dtype, device=packed.device)
    return out.index_put((rows, cols), packed)


__all__ = ["LOGPROB_CHUNK_TOKENS", "fuses_head", "micro_batches", "pack", "plan_micro_batches",
           "token_logprobs", "token_logprobs_and_entropy"]
