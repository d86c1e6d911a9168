"""The run's token: a secret that the commands which change a ZMQ run must carry.

Why: with ``buffer.zmq.auth = "none"`` the broker serves whoever reaches its port, and one
``shutdown`` from any local process stopped it. So the broker refuses the commands that change
the run (:data:`buffers.zmq_protocol.GUARDED`) unless they carry this token, whatever
``auth`` says (CURVE says who may connect, the token who may end or rewind the run).

Where it lives: ``<run_dir>/buffer.token`` (mode 0600), written by `asyncrl up` with the run
directory, or by the first broker started in a run directory without one. `up` hands it to
the roles it starts in :data:`TOKEN_ENV` (Ray actors may run where the run directory is not);
a role started by hand reads the file of its run directory. A client without it can still
put, take, heartbeat and read: only the learner and the launcher send guarded commands.

Redis does not use it: whoever reaches Redis can run any command on the run's keys directly,
so a token checked inside our scripts would stop nobody. Redis's own ``AUTH`` (ACL users,
``buffer.redis.username`` / ``password``) and TLS are what protect a Redis run.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_ENV = "ASYNCRL_RUN_TOKEN"
TOKEN_FILE = "buffer.token"


def token_path(run_dir: Path) -> Path:
    return Path(run_dir) / TOKEN_FILE


def read_token(run_dir: Path) -> str | None:
    """The run's token: :data:`TOKEN_ENV` if set, else the run directory's file; None when
    neither exists (the client then sends no token, and a broker refuses its guarded commands,
    naming where the token is looked for)."""
    value = os.environ.get(TOKEN_ENV, "").strip()
    if value:
        return value
    try:
        return token_path(run_dir).read_text(encoding="ascii").strip() or None
    except FileNotFoundError:
        return None


def ensure_token(run_dir: Path) -> str:
    """The run's token (:func:`read_token`), created in the run directory if there is none:
    written whole to a file of mode 0600, then linked in place (refused if one is there), so
    nobody reads it half-written and two processes racing agree on one token."""
    existing = read_token(run_dir)
    if existing:
        return existing
    path = token_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secrets.token_hex(16) + "\n")
    try:
        os.link(tmp, path)  # atomic, and refused if another process made it first
    except FileExistsError:
        pass  # that process's token is the run's
    finally:
        tmp.unlink()
    return path.read_text(encoding="ascii").strip()
