"""One dataset row as workflows, environments and reward functions see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """A prompt to run an episode on. ``fields`` is the raw row (anything the dataset holds:
    tests for code, an environment's seed, verl's ``data_source`` and ``extra_info``...);
    ``answer`` is the field the config names. ``messages``: the prompt as chat messages
    (``[{"role", "content"}, ...]``, verl's layout), rendered by the model's chat template;
    ``prompt`` is then their text, for logs."""

    sample_id: str
    prompt: str
    answer: Any = None
    fields: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    images: tuple[bytes, ...] = ()
    """The prompt's images, encoded (PNG or JPEG bytes): ``data.image_field``."""
