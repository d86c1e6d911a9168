"""A Redis Cluster is one line too: the quickstart with `--set buffer.type=redis` and the URL of
one node of a real three-node cluster (which does not own the run's slot) runs every role end
to end: the learner trains on what the rollout workers put, and `asyncrl up` resets the run's
keys, found by SCAN across the nodes, on the way in. A short run: learning with Redis is what
test_lora_quickstart shows; this shows the cluster path of every role."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from asyncrl.config.schema import BufferConfig, RedisBufferConfig
from asyncrl.metrics import read_jsonl
from buffers.redis_buffer import reset_run
from tests.buffers.conftest import RedisClusterServer, redis_cluster  # noqa: F401 (fixture)
from tests.integration.conftest import QUICKSTART, Processes

pytestmark = pytest.mark.slow
STEPS = 12


def test_quickstart_runs_on_a_redis_cluster(tmp_path: Path, processes: Processes,
                                            redis_cluster: RedisClusterServer,  # noqa: F811
                                            ) -> None:
    name = next(n for n in (f"cluster-run-{uuid.uuid4().hex[:8]}" for _ in range(100))
                if redis_cluster.owner(f"asyncrl:{n}") != 0)  # not the URL's node: redirects
    namespace = f"{{asyncrl:{name}}}"  # what the run's keys are wrapped in on a cluster
    stray = f"{namespace}:g:left-by-an-earlier-run"
    with RedisCluster.from_url(redis_cluster.url) as admin:
        admin.set(stray, b"x")  # a payload key of a former run of this name: reset deletes it
        up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                             "--set", f"run.name={name}", "--set", "buffer.type=redis",
                             "--set", f"buffer.redis.url={redis_cluster.url}",
                             "--set", f"learner.total_steps={STEPS}",
                             "--set", "eval.every_steps=0")
        try:
            assert processes.wait(up, 300) == 0, processes.log("up")
            records = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl")
                       if isinstance(r.get("step"), int)]
            assert max(r["step"] for r in records) == STEPS
            assert records[-1]["buffer/version"] >= STEPS - 3
            assert admin.exists(stray) == 0
            assert admin.hget(f"{namespace}:state", "consumed") == \
                str(STEPS * 32).encode()  # groups_per_step = 32, each consumed once
        finally:
            reset_run(BufferConfig(type="redis", redis=RedisBufferConfig(url=redis_cluster.url)),
                      name)
        assert not admin.keys(f"{namespace}*".replace("{", "\\{").replace("}", "\\}"),
                              target_nodes=RedisCluster.ALL_NODES)


def test_cluster_detection_and_its_override(redis_cluster: RedisClusterServer,  # noqa: F811
                                           ) -> None:
    """"auto" asks the node; "yes" and "no" do not ask. A cluster has only database 0, and a
    URL naming another is refused whether detected or declared."""
    from buffers.redis_connect import connect

    node = redis_cluster.url  # .../0
    def config(url: str, cluster: str = "auto") -> BufferConfig:
        return BufferConfig(type="redis", redis=RedisBufferConfig(url=url, cluster=cluster))

    with connect(config(node)) as client:
        assert isinstance(client, RedisCluster)
    with connect(config(node, cluster="no")) as client:
        assert type(client) is redis.Redis and client.info("cluster")["cluster_enabled"] == 1
    for cluster in ("auto", "yes"):
        with pytest.raises(ValueError, match=r"buffer.redis.url .*/3'.* only database 0"):
            connect(config(node[:-1] + "3", cluster=cluster))
