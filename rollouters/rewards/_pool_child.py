"""Runs INSIDE a reward pool process (:data:`BOOT`): imports the modules to preload (math-verify
for the math reward: its import is not a call's time), loads the reward function by its import
path, says it is ready, then answers one call at a time until the pool closes the request pipe.

It dies with its parent (``PR_SET_PDEATHSIG``, Linux), so a rollout worker killed by SIGKILL
leaves no reward process behind. Every answer is small (an outcome, a float, a capped message):
one pipe write, which the parent reads whole once the pipe is readable.
"""

import asyncio
import ctypes
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from rollouters.rewards.base import RewardError

# ``python -c BOOT SYS_PATH PATH PRELOAD REQUEST_FD RESULT_FD PARENT WRAP``: the worker's
# sys.path (lines) is this process's before anything is imported, so the reward's path imports
# here as there; PRELOAD: module names, comma-separated; WRAP: empty, or the import path of an
# adapter applied to the function (verl's signature: rollouters.rewards.verl.verl_reward).
BOOT = ("import sys; sys.path[:] = sys.argv.pop(1).split('\\n'); "
        "from rollouters.rewards._pool_child import main; main()")
PR_SET_PDEATHSIG = 1
DETAIL_CHARS = 500


def _die_with(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux follows the thread,
    not the process: the pool's are started by the thread that runs the worker's loop)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _call(fn, request: bytes, loop: asyncio.AbstractEventLoop) -> tuple:
    try:
        response, sample = pickle.loads(request)
        value = fn(response, sample)
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = loop.run_until_complete(value)
        return ("ok", float(value))
    except RewardError as exc:
        return ("reward_error", exc.reason, str(exc)[:DETAIL_CHARS])
    except Exception as exc:  # the user's failure, counted by type in the worker
        return ("error", type(exc).__name__, repr(exc)[:DETAIL_CHARS])


def main() -> None:
    path, preload = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
    request_fd, result_fd, parent = (int(arg) for arg in sys.argv[3:6])
    wrap = sys.argv[6]
    _die_with(parent)
    requests = Connection(request_fd, writable=False)
    results = Connection(result_fd, readable=False)
    try:
        import importlib

        from asyncrl.plugins import load_callable

        for module in preload:
            importlib.import_module(module)
        fn = load_callable(path, "reward.path")
        if wrap:
            fn = load_callable(wrap, "reward.type")(fn)
    except BaseException as exc:
        results.send(("start_failed", f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS]))
        return
    results.send(("ready",))
    loop = asyncio.new_event_loop()
    while True:
        try:
            request = requests.recv_bytes()
        except EOFError:  # the pool closed
            return
        results.send(_call(fn, request, loop))
