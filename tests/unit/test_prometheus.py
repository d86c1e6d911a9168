"""Prometheus /metrics: a real HTTP server answering a real GET in the text exposition format."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from asyncrl.config.schema import MonitorConfig
from asyncrl.prometheus import MetricsEndpoint, buffer_metrics, endpoint_port, metric_name


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics and parse it with Prometheus' own parser: {(name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_ports_are_base_plus_role_offset() -> None:
    cfg = MonitorConfig(prometheus_port=9400)
    assert endpoint_port(cfg, "buffer") == 9400
    assert endpoint_port(cfg, "learner") == 9401
    assert [endpoint_port(cfg, "rollout", i) for i in range(3)] == [9402, 9403, 9404]
    assert endpoint_port(MonitorConfig(), "learner") == 0  # 0 = off
    assert metric_name("actor/loss") == "asyncrl_actor_loss"
    assert metric_name("critic/score/mean") == "asyncrl_critic_score_mean"


def test_endpoint_serves_published_values() -> None:
    endpoint = MetricsEndpoint("127.0.0.1", 0, {"role": "learner", "member": "learner-0"})
    try:
        labels = (("member", "learner-0"), ("role", "learner"))
        assert scrape(endpoint.port) == {}  # nothing published yet
        endpoint.publish({"step": 3, "actor/loss": -0.25, "note": "text", "bad": math.nan,
                          "buffer/staleness_hist": {"0": 5, "2": 1}})
        got = scrape(endpoint.port)
        assert got[("asyncrl_step", labels)] == 3
        assert got[("asyncrl_actor_loss", labels)] == -0.25
        assert got[("asyncrl_buffer_staleness_hist", (*labels, ("staleness", "2")))] == 1
        assert not any(name in ("asyncrl_note", "asyncrl_bad") for name, _ in got)
        endpoint.publish({"step": 4})  # a later step replaces the served values
        assert scrape(endpoint.port) == {("asyncrl_step", labels): 4}
    finally:
        endpoint.close()


def test_a_failing_source_answers_empty_not_500() -> None:
    def broken() -> dict:
        raise TimeoutError("buffer did not answer")

    endpoint = MetricsEndpoint("127.0.0.1", 0, {"role": "buffer", "member": "b"}, broken)
    try:
        assert scrape(endpoint.port) == {}
    finally:
        endpoint.close()


def test_busy_port_is_an_error_naming_the_key_not_a_crash(caplog) -> None:
    from asyncrl.prometheus import start_endpoint

    first = MetricsEndpoint("127.0.0.1", 0, {"role": "learner", "member": "x"})
    try:
        cfg = MonitorConfig(prometheus_port=first.port - 1)  # learner offset 1 → the same port
        assert start_endpoint(cfg, "learner", "learner-0") is None
    finally:
        first.close()
    assert any(r.levelname == "ERROR" and "monitor.prometheus_port" in r.getMessage()
               for r in caplog.records)


def free_port_block(count: int) -> int:
    """A base port P with P .. P + count - 1 all free a moment ago, below the kernel's
    ephemeral range (where outgoing connections of other processes come and go)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 30000)
        try:
            socks = []
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {count} free ports found")


def test_buffer_metrics_flattens_a_status() -> None:
    status = {"depth": 3, "version": 7, "gate_open": True, "run_status": "running",
              "staleness_hist": {"0": 4}, "rejected": {"length": 2},
              "members": {"rollout-0-1": {"role": "rollout", "alive": True, "last_seen_s_ago": 0.5,
                                          "info": {"engine_version": 6}},
                          "learner-0": {"role": "learner", "alive": True, "info": {}}}}
    values = buffer_metrics(status)
    assert values["buffer/depth"] == 3 and values["buffer/gate_open"] is True
    assert "buffer/run_status" not in values
    assert values["buffer/engine_version"] == {"rollout-0-1": 6}
    assert values["buffer/engines_alive"] == 1
