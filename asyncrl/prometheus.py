"""Prometheus ``/metrics`` for each role, so a cluster's existing Prometheus can scrape a run.

Every role serves its latest figures as gauges on ``monitor.prometheus_host`` (127.0.0.1 unless
configured) at ``monitor.prometheus_port`` plus a fixed offset per role (:data:`ROLE_OFFSETS`),
so several roles on one machine never collide and a scrape config can be written in advance.
Metric names are the role's metric names with ``/`` turned into ``_`` and an ``asyncrl_``
prefix (``actor/loss`` → ``asyncrl_actor_loss``); each series carries ``role`` and ``member``
labels. Values are read when Prometheus scrapes, never pushed on a timer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from asyncrl.config.schema import MonitorConfig

logger = logging.getLogger(__name__)

ROLE_OFFSETS = {"buffer": 0, "learner": 1, "rollout": 2}  # rollout worker i: 2 + i
LABEL_NAMES = {"buffer/staleness_hist": "staleness", "buffer/rejected": "reason",
               "buffer/engine_version": "engine", "buffer/heartbeat_age_s": "engine"}
Source = Callable[[], Mapping[str, Any]]


def endpoint_port(cfg: MonitorConfig, role: str, index: int = 0) -> int:
    """The port a role serves /metrics on; 0 when ``monitor.prometheus_port`` is 0 (off)."""
    if not cfg.prometheus_port:
        return 0
    return cfg.prometheus_port + ROLE_OFFSETS[role] + (index if role == "rollout" else 0)


def metric_name(name: str) -> str:
    return "asyncrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_")


class MetricsEndpoint:
    """An HTTP server thread answering ``GET /metrics`` in the Prometheus text format.

    Values come from ``source`` at scrape time, or else from the last :meth:`publish`. A value
    is a number (a gauge) or a mapping of label value → number (one gauge family labelled
    ``LABEL_NAMES[name]``, e.g. the staleness histogram); anything else is skipped.
    """

    def __init__(self, host: str, port: int, labels: Mapping[str, str],
                 source: Source | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.labels = dict(labels)
        self._latest: Mapping[str, Any] = {}
        self._source = source or (lambda: self._latest)
        registry = CollectorRegistry(auto_describe=False)  # own registry: no global state
        registry.register(self)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port
        logger.info("serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def publish(self, values: Mapping[str, Any]) -> None:
        """Replace the served values (one reference swap: safe against a concurrent scrape)."""
        self._latest = dict(values)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            values = self._source()
        except Exception as exc:  # a failed scrape must not kill the role: report and go on
            logger.warning("metrics source failed: %s", exc)
            return
        keys = list(self.labels)
        for name, value in values.items():
            label = LABEL_NAMES.get(name, "key")
            if isinstance(value, Mapping):
                family = GaugeMetricFamily(metric_name(name), name, labels=[*keys, label])
                for key, v in value.items():
                    if _is_number(v):
                        family.add_metric([*self.labels.values(), str(key)], float(v))
            elif _is_number(value):
                family = GaugeMetricFamily(metric_name(name), name, labels=keys)
                family.add_metric(list(self.labels.values()), float(value))
            else:
                continue
            yield family

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value  # NaN is left out


def start_endpoint(cfg: MonitorConfig, role: str, member: str, index: int = 0,
                   source: Source | None = None) -> MetricsEndpoint | None:
    """The role's endpoint, or None when ``monitor.prometheus_port`` is 0 or its port cannot
    be bound: watching a run must never stop it, so that is logged as an error, not raised."""
    port = endpoint_port(cfg, role, index)
    if not port:
        return None
    try:
        return MetricsEndpoint(cfg.prometheus_host, port, {"role": role, "member": member},
                               source)
    except OSError as exc:
        logger.error("monitor.prometheus_port: cannot serve %s metrics on %s:%d (%s); "
                     "running without them", role, cfg.prometheus_host, port, exc)
        return None


def buffer_metrics(status: Mapping[str, Any]) -> dict[str, Any]:
    """The buffer's status as gauges: its counters, the staleness histogram, rejections by
    reason, and each rollout engine's version and heartbeat age."""
    values: dict[str, Any] = {f"buffer/{k}": v for k, v in status.items()
                              if isinstance(v, (int, float))}
    values["buffer/staleness_hist"] = status.get("staleness_hist", {})
    values["buffer/rejected"] = status.get("rejected", {})
    engines = {name: m for name, m in status.get("members", {}).items()
               if m.get("role") == "rollout"}
    values["buffer/engine_version"] = {n: m.get("info", {}).get("engine_version")
                                       for n, m in engines.items()}
    values["buffer/heartbeat_age_s"] = {n: m.get("last_seen_s_ago") for n, m in engines.items()}
    values["buffer/engines_alive"] = sum(bool(m.get("alive")) for m in engines.values())
    return values


class StatusSource:
    """Reads the buffer's status through a client of its own for each scrape; the HTTP
    server answers on several threads and a buffer client belongs to one, hence the lock."""

    def __init__(self, client) -> None:
        self.client = client
        self.lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self.lock:
            return buffer_metrics(self.client.status())
