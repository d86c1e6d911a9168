"""`asyncrl buffer` serves /metrics: the broker's live counters, read at each scrape."""

from __future__ import annotations

from pathlib import Path

from buffers import connect_buffer
from tests.integration.conftest import QUICKSTART, Processes, wait_for
from tests.unit.test_prometheus import free_port_block, scrape


def test_buffer_role_serves_its_status(tmp_path: Path, processes: Processes) -> None:
    from asyncrl.config import load_config

    port = free_port_block(1)
    sets = [f"run.output_dir={tmp_path}", f"monitor.prometheus_port={port}"]
    _, address = processes.start_buffer(str(QUICKSTART), *(a for s in sets for a in ("--set", s)))

    def served() -> dict:
        try:
            return scrape(port)
        except OSError:
            return {}

    wait_for(lambda: served(), 30, "the buffer's /metrics")
    labels = (("member", "buffer"), ("role", "buffer"))
    assert served()[("asyncrl_buffer_version", labels)] == 0

    client = connect_buffer(load_config(QUICKSTART, sets), address)
    try:
        client.heartbeat("rollout-0-1", "rollout", {"engine_version": 0})
        client.publish_version(1)
    finally:
        client.close()
    got = served()
    assert got[("asyncrl_buffer_version", labels)] == 1
    assert got[("asyncrl_buffer_engines_alive", labels)] == 1
    assert got[("asyncrl_buffer_engine_version", (("engine", "rollout-0-1"), *labels))] == 0
