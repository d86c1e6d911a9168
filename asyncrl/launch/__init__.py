"""Starting and supervising the roles: `asyncrl up` and the roles' own processes.

- :mod:`~asyncrl.launch.local`: `asyncrl up` with local OS processes (``launcher.type =
  "local"``); :mod:`~asyncrl.launch.ray`: the same on a Ray cluster (``"ray"``).
- :mod:`~asyncrl.launch.roles`: the entry points of `asyncrl buffer|learner|rollout`, and the
  children a role spawns (rollout workers, learner ranks).
- :mod:`~asyncrl.launch.restart`: the one restart policy all of them apply;
  :mod:`~asyncrl.exits`: the exit statuses they read; :mod:`~asyncrl.launch.signals`:
  what a first and a second Ctrl-C do.
- :mod:`~asyncrl.launch.run_dir`: the run directory a run starts or resumes in;
  :mod:`~asyncrl.launch.preflight`: the checks before anything starts;
  :mod:`~asyncrl.launch.actor_paths`: the driver's paths, for Ray actors.

Nothing here imports torch or Ray at module level: `asyncrl --help` and the monitor stay quick.
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.launch.local import LocalLauncher


def make_launcher(cfg: Config, out: IO[str] = sys.stdout) -> LocalLauncher:
    """The launcher ``launcher.type`` names (both have ``up()`` and ``plan()``)."""
    if cfg.launcher.type == "ray":
        from asyncrl.launch.ray import RayLauncher

        return RayLauncher(cfg, out)  # type: ignore[return-value]
    from asyncrl.launch.local import LocalLauncher

    return LocalLauncher(cfg, out)
