"""A learner starved for data keeps its last step in its heartbeat, so the monitor still shows
that step and says the learner is waiting (a real ZMQ broker, the learner's own wait loop)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from asyncrl.config import load_config
from buffers.zmq_client import ZmqBufferClient
from learners.batch_feed import BatchFeed
from learners.loop import _next_batch
from learners.lost import Lost
from learners.prefetch import BatchPrefetcher
from learners.rank_role import RankContext
from tests.unit.test_dashboard import screen
from tests.unit.test_zmq_buffer import broker, client  # noqa: F401 (fixtures)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"


def test_waiting_learner_keeps_its_last_step_on_screen(broker, client) -> None:  # noqa: F811
    address = broker()
    buffer = client(address)
    cfg = load_config(QUICKSTART)
    ctx = RankContext(cfg, 0, 1, buffer, "learner-0")
    last = {"step": 4, "critic/score/mean": 0.625, "timing/step": 1.0, "timing/wait_data": 0.5}
    # Rank 0's role as _next_batch sees it: the last step's record; no engines to re-sync;
    # the batch fetched by its prefetcher (the buffer stays empty).
    prefetcher = BatchPrefetcher(ZmqBufferClient(address), "learner-0",
                                 cfg.learner.groups_per_step, lambda batch: batch, 2.0, 60.0)
    role = SimpleNamespace(last_record=last, resync_late_joiners=lambda version: None,
                           poll=BatchFeed(ctx, prefetcher).poll)
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)  # stop during the first empty long poll
    timer.start()
    try:
        assert _next_batch(ctx, role, 4, stop, Lost()) is None
    finally:
        timer.cancel()
        prefetcher.close()
    status = buffer.status()
    info = status["members"]["learner-0"]["info"]
    assert info["step"] == 4 and info["state"] == "waiting for data" and info["version"] == 4
    text = screen(status)
    assert "(waiting for data)" in text and "reward 0.625" in text
    assert "idle: learner 50%" in text
