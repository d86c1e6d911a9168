"""A learner stand-in for the SIGKILL fault test, run as its own process.

``python -m tests.buffers.fault_consumer SPEC_JSON OUT_DIR COUNT BATCHES``: takes ``BATCHES``
batches of ``COUNT`` groups, "trains" on each, acks it and only then appends its group ids to
``OUT_DIR/acked`` (flushed and fsynced). Then it takes one more batch, writes its ids to
``OUT_DIR/holding`` (atomically) and waits, never acking, for the test to SIGKILL it. So the
record is exact: an id in ``acked`` was acked; an id in ``holding`` was served and not acked.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

from asyncrl.config.schema import BufferConfig
from buffers import make_buffer_client

logger = logging.getLogger("fault_consumer")
TAKE_TIMEOUT_S = 60.0
WAIT_FOR_KILL_S = 120.0  # only if the test died first: then leave on our own


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def main(argv: list[str]) -> int:
    spec, out_dir, count, batches = json.loads(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    client = make_buffer_client(BufferConfig(**spec["config"]), spec["address"],
                                run_id=spec["run_id"], groups_per_step=spec["groups_per_step"],
                                token=spec["token"])
    with (out_dir / "acked").open("a") as acked:
        for _ in range(batches):
            batch = client.get_batch("learner", count, 0, TAKE_TIMEOUT_S)
            if batch is None:
                logger.error("no batch within %.0fs", TAKE_TIMEOUT_S)
                return 1
            client.ack("learner", batch)
            acked.write("".join(f"{g.group_id}\n" for g in batch.groups))
            acked.flush()
            os.fsync(acked.fileno())
    batch = client.get_batch("learner", count, 0, TAKE_TIMEOUT_S)
    if batch is None:
        return 1
    _write_atomically(out_dir / "holding", "".join(f"{g.group_id}\n" for g in batch.groups))
    threading.Event().wait(WAIT_FOR_KILL_S)
    return 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
