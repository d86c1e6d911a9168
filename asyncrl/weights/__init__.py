"""Learner → engine weight sync, both ends of it: learner rank 0 broadcasts each version, every
rollout engine receives it.

- :mod:`~asyncrl.weights.broadcaster`: :class:`WeightBroadcaster` (rank 0), the announcement
  format, membership epochs, eviction; ``engine_weights`` and ``broadcast_align`` (what an
  engine kind needs of the plan).
- :mod:`~asyncrl.weights.membership`: whom the broadcaster sends to, and whom it gives up on
  (departed or frozen members), with the reasons.
- :mod:`~asyncrl.weights.receiver`: :class:`WeightReceiver`, one thread per engine.
- :mod:`~asyncrl.weights.publisher`: :class:`WeightPublisher`, the broadcast and the version
  publish off the learner's critical path.
- :mod:`~asyncrl.weights.plan`: the bucket plan, packing and unpacking (pure, any device).
- :mod:`~asyncrl.weights.rendezvous`: control-plane keys, the epoch's store, bounded waits.
- :mod:`~asyncrl.weights.transport`: the :class:`WeightTransport` protocol, its factory and
  the ``auto`` rule, with :mod:`~asyncrl.weights.group` (``gloo`` and ``nccl``: one code
  path, bounded by :mod:`~asyncrl.weights.watchdog`), :mod:`~asyncrl.weights.ipc` (CUDA IPC
  on a shared GPU) and :mod:`~asyncrl.weights.sim` behind it.
- :mod:`~asyncrl.weights.fanout`: every learner rank serves its slice of the engines
  (:mod:`~asyncrl.weights.slices`: who serves whom).
- :mod:`~asyncrl.weights.lora_wire`: how LoRA adapters travel, and the merge rule both ends use.

Learners and rollouters both use this package and never each other. This ``__init__`` imports
nothing, so ``import asyncrl.weights`` stays free of torch; the submodules import torch at
module level, and are themselves imported only lazily by the roles that sync weights.
"""
