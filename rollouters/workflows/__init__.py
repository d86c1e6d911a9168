"""Workflows: turn prompts into scored trajectory groups through any engine."""

from rollouters.workflows.single_turn import generate_groups

__all__ = ["generate_groups"]
