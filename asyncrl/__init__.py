"""asyncrl core: config, wire format, staleness gate, CLI, launcher, monitor.

Nothing in this package imports torch at module level, so ``asyncrl --help``, the monitor and
the buffer start instantly and run on machines without torch. The one exception is the
modules of ``asyncrl.weights`` (its ``__init__`` imports nothing), which only the roles that
sync weights import, lazily.
"""

__version__ = "0.1.0"
