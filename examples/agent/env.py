"""An example user environment, loaded by import path: `workflow.env = "examples.agent.env:AddEnv"`.

The user message is two digits ("34"). The model has a tool, `add(a,b)`, and must answer with
the sum: call `add(3,4)`, read `7`, answer `7`. Any class with `reset(sample) -> str` and
`step(action) -> StepResult` works (methods may be async); `samples` and `eval_samples` are
optional: without them, set `data.path` and `data.eval_path`.
"""

from __future__ import annotations

import random

from rollouters.envs.lookup import positional_score
from rollouters.tasks.sample import Sample
from rollouters.workflows.multi_turn import Action, StepResult


class AddEnv:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.a = self.b = 0
        self.turn = 0

    def reset(self, sample: Sample) -> str:
        self.a, self.b = int(sample.prompt[0]), int(sample.prompt[1])
        self.turn = 0
        return sample.prompt

    def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            wanted = f"add({self.a},{self.b})"
            reward = 0.5 * positional_score(list(wanted), list(action.text))
            call = action.tool_call
            if call is None or call.name != "add":
                return StepResult("", reward, done=True)
            try:
                result = str(sum(int(x) for x in call.arguments["arg"].split(",")))
            except ValueError:
                result = "0"
            return StepResult(result, reward, done=False)
        answer = str(self.a + self.b)
        return StepResult("", 0.5 * positional_score(list(answer), list(action.text)), True)

    @staticmethod
    def samples(rng: random.Random, n: int) -> list[Sample]:
        return [_sample(rng.randrange(10), rng.randrange(10)) for _ in range(n)]

    @staticmethod
    def eval_samples() -> list[Sample]:
        return [_sample(a, b) for a in range(0, 10, 3) for b in range(10)]


def _sample(a: int, b: int) -> Sample:
    return Sample(sample_id=f"add:{a}{b}", prompt=f"{a}{b}")
