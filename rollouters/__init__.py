"""Rollout fleets: the worker loop, inference engines, workflows, rewards and tasks."""
