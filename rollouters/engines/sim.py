"""A simulated engine: the :class:`~rollouters.engines.base.Engine` contract with waits for compute.

``rollout.engine = "sim"`` keeps every real code path around the engine (the worker loop, the
gate, the buffer, the weight receiver, per-token versions) and replaces only the model's
arithmetic by a calibrated clock, so that bench/pipeline.py can run 64 engines on two cores.

The timing model of one :meth:`SimEngine.generate` call (one batch, as with the real engines):
every sequence gets a length from the configured distribution (capped at ``max_new_tokens``);
decode step ``k`` runs the ``a_k`` sequences still active and takes
``decode_step_s · (1 + batch_slowdown · (a_k − 1) / max_batch)``; the call returns when the
longest sequence ends. Weight updates behave as on the torch engine: :meth:`load_weights` lands
between two decode steps, and a token's version is the one loaded when its step ended, so a
call that spans an update yields mixed versions.
"""

from __future__ import annotations

import bisect
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from asyncrl.config.schema import SimConfig
from rollouters.engines.base import Completion, check_generate_args

logger = logging.getLogger(__name__)

SIM_LOGPROB = -1.0  # a behaviour logprob for every simulated token (nothing recomputes it)


def sample_lengths(rng: np.random.Generator, cfg: SimConfig, count: int,
                   max_new_tokens: int) -> np.ndarray:
    """``count`` response lengths in [1, max_new_tokens] from ``cfg.length``.

    lognormal is parameterised by its mean: ``mu = ln(mean) − σ²/2``, so changing ``sigma``
    changes the tail, not the average work (before the cap)."""
    mean = cfg.mean_tokens
    if cfg.length == "fixed":
        raw = np.full(count, mean)
    elif cfg.length == "uniform":
        raw = rng.uniform(1.0, 2.0 * mean - 1.0, count) if mean > 1 else np.ones(count)
    else:
        raw = rng.lognormal(np.log(mean) - cfg.sigma ** 2 / 2, cfg.sigma, count)
    return np.clip(np.rint(raw), 1, max_new_tokens).astype(np.int64)


def step_end_times(cfg: SimConfig, lengths: np.ndarray) -> np.ndarray:
    """Seconds from the call's start to the end of each decode step (``max(lengths)`` steps)."""
    if lengths.size == 0:
        return np.zeros(0)
    steps = np.arange(1, int(lengths.max()) + 1)
    ordered = np.sort(lengths)
    active = lengths.size - np.searchsorted(ordered, steps, side="left")  # a_k: length ≥ k
    durations = cfg.decode_step_s * (1.0 + cfg.batch_slowdown * (active - 1) / cfg.max_batch)
    return cfg.prefill_s + np.cumsum(durations)


class SimEngine:
    """Implements :class:`~rollouters.engines.base.Engine` with waits instead of compute.

    Tokens are drawn from ``token_ids`` (the last one of a sequence that stops is ``eos_id``),
    every logprob is :data:`SIM_LOGPROB`. ``clock``/``sleep`` are injectable for tests; the
    default sleep is interrupted by :meth:`close`.
    """

    def __init__(self, cfg: SimConfig, eos_id: int, token_ids: Sequence[int], seed: int = 0,
                 version: int = 0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None) -> None:
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        self.cfg = cfg
        self.eos_id = eos_id
        self._token_ids = list(token_ids)
        self._np_rng = np.random.default_rng(seed)
        self._rng = random.Random(seed)
        self._clock = clock
        self._closed = threading.Event()
        self._sleep = sleep or (lambda s: self._closed.wait(s))
        self._lock = threading.Lock()
        # Version timeline: (time loaded, version), ascending; generate() reads it afterwards.
        self._times: list[float] = [float("-inf")]
        self._versions: list[int] = [version]

    @property
    def version(self) -> int:
        with self._lock:
            return self._versions[-1]

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False) -> list[list[Completion]]:
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy)
        count = len(prompts) * n
        with self._lock:
            lengths = sample_lengths(self._np_rng, self.cfg, count, max_new_tokens)
        start = self._clock()
        ends = start + step_end_times(self.cfg, lengths)
        remaining = ends[-1] - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        step_versions = self._versions_at(ends)
        out = [self._completion(int(length), max_new_tokens, step_versions)
               for length in lengths]
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _versions_at(self, ends: np.ndarray) -> list[int]:
        """The version in effect at the end of each decode step."""
        with self._lock:
            times, versions = list(self._times), list(self._versions)
        return [versions[bisect.bisect_right(times, t) - 1] for t in ends.tolist()]

    def _completion(self, length: int, max_new_tokens: int, versions: list[int]) -> Completion:
        stops = length < max_new_tokens
        tokens = [self._rng.choice(self._token_ids) for _ in range(length - stops)]
        tokens += [self.eos_id] * stops
        return Completion(tokens=tokens, logprobs=[SIM_LOGPROB] * length,
                          versions=versions[:length], finish_reason="stop" if stops else "length")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take ``version`` from now on (the tensors are not used: there is no model)."""
        for _ in weights:
            pass
        with self._lock:
            self._times.append(self._clock())
            self._versions.append(version)
            if len(self._times) > 4096:  # keep it short: a call looks back one call only
                self._versions[0] = self._versions[2047]  # in effect before what remains
                del self._times[1:2048], self._versions[1:2048]
        logger.debug("sim engine: version %d", version)

    def close(self) -> None:
        self._closed.set()
