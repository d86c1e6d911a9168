"""Verifiable tasks: prompts, targets and rewards computed from the sampled tokens."""

from rollouters.tasks.digits import DigitTask, Prompt, Task, is_held_out, make_task

__all__ = ["DigitTask", "Prompt", "Task", "is_held_out", "make_task"]
