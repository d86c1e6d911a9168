"""A reward with verl's signature, as a verl user brings it: ``reward.type = "verl"``,
``reward.path = "examples.verl.reward:compute_score"``. It returns a dict with ``score`` (what
is trained on) and another metric, as verl's reward functions may."""

from __future__ import annotations


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict | None = None) -> dict[str, float]:
    """The fraction of digits right, position by position (dense), and exact-match ``acc``."""
    got = solution_str.strip()
    hits = sum(a == b for a, b in zip(ground_truth, got))
    return {"score": hits / max(len(ground_truth), len(got), 1),
            "acc": float(got == ground_truth)}
