"""Built-in environments for multi-turn agent workflows (user envs load by import path)."""

from rollouters.envs.lookup import LookupEnv

BUILTIN_ENVS = {"lookup": LookupEnv}

__all__ = ["BUILTIN_ENVS", "LookupEnv"]
