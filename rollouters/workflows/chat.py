"""Chat templates and tool calls, token-exact for multi-turn episodes.

The model's own tokens are kept exactly as generated (their logprobs must match what is
trained); only the text the environment adds is rendered through the tokenizer's chat template,
as the difference between the template with and without the new messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.tokens import encode_strict, tokens_of

ToolFormat = Literal["hermes", "compact"]
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"^\s*([A-Za-z_]\w*)\((.*?)\)?\s*$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def parse_tool_call(text: str, fmt: ToolFormat) -> ToolCall | None:
    """The tool call in a model response, or None if the response is not one.

    ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes).
    ``compact``: the whole response is ``name(arg)``, e.g. ``lookup(12)``, the closing bracket
    optional (the end of the turn closes the call); the argument string is
    ``arguments["arg"]`` (for tiny vocabularies that cannot spell JSON).
    """
    if fmt == "hermes":
        match = _HERMES.search(text)
        if match is None:
            return None
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        arguments = payload.get("arguments") or {}
        return ToolCall(payload["name"], arguments if isinstance(arguments, dict) else {})
    match = _COMPACT.match(text)
    return ToolCall(match.group(1), {"arg": match.group(2).strip()}) if match else None


class ChatFormat:
    """Token-level rendering of a conversation through ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template: multi-turn workflows need one "
                             "(model.path's tokenizer_config.json, or the tiny model's)")
        self.tokenizer = tokenizer
        # The model's EOS ids (asyncrl.tokens.special_tokens), else the tokenizer's own.
        self._eos_ids = frozenset(tokens_of(tokenizer).eos_ids if eos_ids is None else eos_ids)

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return encode_strict(self.tokenizer, text)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render(messages, generation_prompt=True))

    def continuation_tokens(self, history: list[dict[str, str]],
                            new: list[dict[str, str]]) -> list[int]:
        """Tokens the template adds for ``new`` messages after ``history`` (which ends with the
        model's turn), up to and including the next generation prompt."""
        before = self.render(history, generation_prompt=False)
        after = self.render(history + new, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template is not prefix-stable: rendering more messages "
                             "changed the text of earlier ones")
        return self.encode(after[len(before):])

    def decode_response(self, tokens: list[int]) -> str:
        """The text of a model turn, without the EOS token that ended it (any of the model's
        EOS ids)."""
        if tokens and tokens[-1] in self._eos_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)
