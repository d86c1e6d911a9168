"""What the learner asks of an evaluator: the score of a version's weights.

Learner rank 0 evaluates every ``eval.every_steps`` and at the end of the run, yet scoring
needs an engine and the task's workflow, which live in ``rollouters``. The learner sees only
this protocol; the composition root (``asyncrl.launch.roles``, ``asyncrl.launch.ray``) hands
:func:`learners.loop.run_learner_rank` a factory built from the rollouters' code
(:class:`rollouters.eval.EngineEvaluator`), so neither package imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.tokens import ModelTokenizer


class Evaluator(Protocol):
    def evaluate(self, state: Mapping[str, Any], version: int) -> dict[str, float]:
        """The metrics (``val/...``) of the weights ``state`` (full, as the engines get them)
        trained up to ``version``."""


# Built once, on learner rank 0, from the run's config and the tokenizer of its initial model
# (``ModelTokenizer.model_dir``: the model), which rank 0 has loaded already.
EvaluatorFactory = Callable[["Config", "ModelTokenizer"], Evaluator]
