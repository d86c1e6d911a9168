"""The ids that end, pad and begin a sequence, read from the model's own files.

Every engine, the learner and eval ask :func:`special_tokens` instead of assuming the tiny
tokenizer's ids: a real model stops at its own end-of-sequence ids (often several: Qwen2.5's
``generation_config.json`` lists ``<|im_end|>`` and ``<|endoftext|>``), and one whose id 3 is
an ordinary token must not be cut off there. The rules follow what ``transformers``'
``generate`` does, since that is what a model's authors tested:

- **EOS**: every id of ``generation_config.json``'s ``eos_token_id`` (an int or a list), plus
  the tokenizer's ``eos_token_id`` (a chat model's turn end is sometimes only there). None at
  all is an error: every response would run to ``rollout.max_new_tokens``.
- **pad**: the tokenizer's ``pad_token_id``, else the generation config's, else the first EOS
  id (a pad id is only a filler that the loss masks; any id in the vocabulary works).
- **BOS**: the tokenizer's ``bos_token_id`` or the generation config's (None if neither).

Reading needs only the JSON files (``generation_config.json``, ``config.json``) and the
tokenizer, so it costs milliseconds; torch is not imported. Loading the tokenizer is what costs:
a role makes one :class:`ModelTokenizer` as it starts and hands it to what needs the tokenizer
or the ids, so that each process loads it once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ModelTokenizer", "SpecialTokens", "encode_strict", "special_tokens", "tokens_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecialTokens:
    """A model's end-of-sequence ids (any of them ends a response), pad and BOS ids."""

    eos_ids: tuple[int, ...]
    pad_id: int
    bos_id: int | None = None

    def __post_init__(self) -> None:
        if not self.eos_ids:
            raise ValueError("a model needs at least one end-of-sequence id")

    @property
    def eos_id(self) -> int:
        """The first EOS id: the one a chat template writes after a turn."""
        return self.eos_ids[0]

    def cut(self, tokens: list[int]) -> tuple[list[int], bool]:
        """``tokens`` up to and including the first EOS, and whether one was found."""
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return tokens[:i + 1], True
        return tokens, False


def tokens_of(tokenizer: PreTrainedTokenizerBase,
              generation: dict[str, Any] | None = None) -> SpecialTokens:
    """The special ids ``tokenizer`` and a ``generation_config.json``'s contents declare."""
    generation = generation or {}
    eos: list[int] = []
    for source in (generation.get("eos_token_id"), tokenizer.eos_token_id):
        for token in _ids(source):
            if token not in eos:
                eos.append(token)
    if not eos:
        raise ValueError(
            "the model declares no end-of-sequence token (neither generation_config.json's "
            "eos_token_id nor the tokenizer's eos_token): every response would run to "
            "rollout.max_new_tokens; add eos_token_id to generation_config.json")
    pad = _first(tokenizer.pad_token_id, generation.get("pad_token_id"))
    if pad is None:
        pad = eos[0]
        logger.info("the model declares no pad token: padding with its EOS id %d", pad)
    return SpecialTokens(tuple(eos), pad, _first(tokenizer.bos_token_id,
                                                  generation.get("bos_token_id")))


def special_tokens(model_dir: str | Path,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> SpecialTokens:
    """The special ids of the model saved in ``model_dir`` (a local directory or a hub id).

    ``tokenizer`` saves loading it again where the caller has it already."""
    from asyncrl.models import load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
    return tokens_of(tokenizer, _generation_config(model_dir))


class ModelTokenizer:
    """The tokenizer of the model in ``model_dir`` and its special ids, each read at most once,
    when first asked for. A role makes one as it starts and passes it to its engine, producer
    and evaluator, so that the process loads the tokenizer once (each of them used to load its
    own). A role that needs neither (the sim engine on a digit task) never loads it.

    ``load``: the loader (:func:`asyncrl.models.load_tokenizer` unless given)."""

    def __init__(self, model_dir: str | Path,
                 load: Callable[[str | Path], PreTrainedTokenizerBase] | None = None) -> None:
        self.model_dir = model_dir
        self._load = load

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._load is None:
            from asyncrl.models import load_tokenizer

            return load_tokenizer(self.model_dir)
        return self._load(self.model_dir)

    @cached_property
    def special(self) -> SpecialTokens:
        """The model's EOS, pad and BOS ids (:func:`special_tokens`)."""
        return special_tokens(self.model_dir, self.tokenizer)


def encode_strict(tokenizer: PreTrainedTokenizerBase, text: str,
                  add_special_tokens: bool = False) -> list[int]:
    """``text``'s ids, refusing characters the tokenizer can only encode as its unknown token
    (the tiny tokenizer's ``<pad>``; byte-level BPE has none and never refuses): a prompt
    silently turned into padding trains a model on something else than the data says."""
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    unk = tokenizer.unk_token_id
    if unk is None or unk not in ids or tokenizer.unk_token in text:
        return ids
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unknown = sorted({text[start:end] for token, (start, end)
                      in zip(encoded["input_ids"], encoded["offset_mapping"]) if token == unk})
    raise ValueError(f"{''.join(unknown)!r} cannot be encoded by the model's tokenizer (each "
                     f"would become {tokenizer.unk_token}); with the tiny model, add what the "
                     "data needs to model.tiny.extra_tokens")


def _generation_config(model_dir: str | Path) -> dict[str, Any]:
    """``generation_config.json`` as a dict, falling back to ``config.json``'s token ids (older
    checkpoints have only those); empty for a hub id (the tokenizer then decides)."""
    directory = Path(model_dir).expanduser()
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            if data.get("eos_token_id") is not None:
                return data
    if directory.is_dir():
        return {}
    from transformers import GenerationConfig  # a hub id: the resolver reads the cache

    try:
        return GenerationConfig.from_pretrained(str(model_dir)).to_dict()
    except OSError:
        return {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _first(*values: Any) -> int | None:
    for value in values:
        ids = _ids(value)
        if ids:
            return ids[0]
    return None
