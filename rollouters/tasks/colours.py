"""A visual task a random-init tiny VLM learns on a CPU: name the colour of an image.

The prompt is ``<bos>``, one image, ``<sep>``: no text carries the answer, so only the image
can lead to it (chance: 1 in :data:`COLOURS`' four). The image is one of four colours, its
shade moved by up to ±40 per channel and with ±12 of pixel noise, drawn from an instance
seed; the answer is the colour's digit (``1``..``4``), then ``<eos>``. Instances
``(colour, seed)`` are split by a stable hash (``crc32 % 8 == 0`` held out), so no eval image
is ever trained on. The reward is the digit task's (positions matched, EOS included).

Needs the tiny VLM (``model.tiny.vision.depth > 0``): the image tokens' ids are those its
char tokenizer gives them (:func:`asyncrl.vlm.IMAGE_TOKENS` after ``model.tiny.extra_tokens``).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import numpy as np

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import TaskConfig, TinyModelConfig
from asyncrl.models import BOS_ID, DIGIT_OFFSET, EOS_ID, SEP_ID, VOCAB
from asyncrl.vlm import encode_png
from rollouters.tasks.digits import HOLDOUT_MODULUS, Prompt, exact_match, positions_matched

COLOURS: tuple[tuple[int, int, int], ...] = ((200, 40, 40), (40, 200, 40), (40, 40, 200),
                                             (200, 200, 40))
SEEDS = 4096
"""Instance seeds per colour: 16k images, 2k of them held out."""
SHADE, NOISE = 40, 12


class ColourTask:
    """The colour task over the tiny VLM's token ids; a :class:`~rollouters.tasks.digits.Task`."""

    name = "colour"

    def __init__(self, tiny: TinyModelConfig, eval_size: int, seed: int) -> None:
        vision = tiny.vision
        if not vision.depth:
            raise ConfigError("task.name = \"colour\" needs a vision-language model: set "
                              "model.tiny.vision.depth > 0")
        first = len(VOCAB) + len([t for t in dict.fromkeys(tiny.extra_tokens) if t not in VOCAB])
        self.vision_start, self.image_pad, self.vision_end = first, first + 1, first + 2
        self.image_size = vision.image_size
        self.image_tokens = (vision.image_size // vision.patch_size // vision.merge_size) ** 2
        train, held_out = [], []
        for colour in range(len(COLOURS)):
            for instance in range(SEEDS):
                (held_out if _held_out(colour, instance) else train).append((colour, instance))
        if eval_size > len(held_out):
            raise ConfigError(f"task.eval_size = {eval_size} exceeds the {len(held_out)} "
                              "held-out images of the colour task")
        self._train = train
        self._eval = random.Random(f"colour-{seed}-eval").sample(held_out, eval_size)

    def make_prompt(self, colour: int, instance: int) -> Prompt:
        ids = [BOS_ID, self.vision_start, *[self.image_pad] * self.image_tokens,
               self.vision_end, SEP_ID]
        return Prompt(prompt_id=f"colour:{colour}:{instance}", tokens=ids,
                      target=[DIGIT_OFFSET + colour + 1, EOS_ID],
                      images=(self.image(colour, instance),))

    def image(self, colour: int, instance: int) -> bytes:
        """The PNG of instance ``instance`` of ``colour``: the same bytes in every process."""
        rng = np.random.default_rng([colour, instance])
        base = np.array(COLOURS[colour]) + rng.integers(-SHADE, SHADE + 1, 3)
        noise = rng.integers(-NOISE, NOISE + 1, (self.image_size, self.image_size, 3))
        return encode_png(np.clip(base + noise, 0, 255).astype(np.uint8))

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self.make_prompt(*rng.choice(self._train)) for _ in range(n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self.make_prompt(*instance) for instance in self._eval]

    def reward(self, prompt: Prompt, completion_tokens: Sequence[int]) -> float:
        """The digit tasks' reward: the digit, then EOS, position by position."""
        return positions_matched(prompt.target, completion_tokens)

    def exact(self, prompt: Prompt, completion_tokens: Sequence[int]) -> bool:
        return exact_match(prompt.target, completion_tokens)


def _held_out(colour: int, instance: int) -> bool:
    return zlib.crc32(f"{colour}:{instance}".encode()) % HOLDOUT_MODULUS == 0


def make_colour_task(cfg: TaskConfig, tiny: TinyModelConfig, seed: int) -> ColourTask:
    return ColourTask(tiny, cfg.eval_size, seed)


__all__ = ["COLOURS", "ColourTask", "make_colour_task"]
