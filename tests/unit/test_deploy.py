"""deploy/ checked as far as a machine without Kubernetes, Slurm or Docker allows: the YAML
parses and has the keys its schema requires, the Slurm script passes `bash -n` and its
DRY_RUN=1 commands are valid asyncrl command lines, and `asyncrl up --dry-run` prints what each
launcher would start."""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
from pathlib import Path

import yaml

from asyncrl.cli import _parser, main
from asyncrl.config.load import validate_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def _require(node: dict, path: str) -> object:
    """``node[a][b]...`` for ``path = "a.b"``, failing with the missing key's path."""
    for key in path.split("."):
        assert isinstance(node, dict) and key in node, f"missing {path} (at {key!r})"
        node = node[key]
    return node


def test_rayjob_manifest_has_the_required_keys_and_a_valid_config():
    config_map, job = yaml.safe_load_all((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert _require(job, "spec.entrypoint").startswith("asyncrl up ")
    head = _require(job, "spec.rayClusterSpec.headGroupSpec")
    assert isinstance(_require(head, "rayStartParams"), dict)
    assert _require(head, "template.spec.containers")[0]["image"]
    groups = _require(job, "spec.rayClusterSpec.workerGroupSpecs")
    for group in groups:
        for key in ("groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams"):
            _require(group, key)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert _require(group, "template.spec.containers")[0]["image"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # KubeRay wants str
    # The entrypoint's config is the ConfigMap's, mounted where the entrypoint reads it.
    assert config_map["kind"] == "ConfigMap"
    import tomllib

    cfg = validate_config(tomllib.loads(config_map["data"]["config.toml"]))
    assert (cfg.launcher.type, cfg.launcher.address) == ("ray", "auto")
    assert (cfg.buffer.zmq.host, cfg.weights.host) == ("0.0.0.0", "auto")  # reachable across pods
    mounts = head["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(job["spec"]["entrypoint"].split()[2].startswith(m["mountPath"]) for m in mounts)
    learners = next(g for g in groups if g["groupName"] == "learners")
    gpus = int(learners["template"]["spec"]["containers"][0]["resources"]["limits"]
               ["nvidia.com/gpu"])
    assert learners["replicas"] * gpus >= cfg.learner.ranks * cfg.resources.learner.gpus


def test_redis_compose_file_keeps_data_and_needs_a_password():
    compose = yaml.safe_load((DEPLOY / "redis" / "docker-compose.yml").read_text())
    redis = _require(compose, "services.redis")
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--requirepass" in command
    assert "noeviction" in command  # a full Redis must refuse writes, never drop stream entries
    assert redis["ports"] == ["${BIND_ADDR:-127.0.0.1}:6379:6379"]  # loopback unless told
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in compose["volumes"]


def _dry_run_slurm(nodes: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / "slurm" / "asyncrl.sbatch"), "cfg.toml"],
                          env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "DRY_RUN_NODES": nodes,
                               "ROLLOUT_WORKERS": "4"},
                          capture_output=True, text=True, timeout=30)


def test_slurm_script_parses_and_its_dry_run_steps_are_valid_commands():
    script = DEPLOY / "slurm" / "asyncrl.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    done = _dry_run_slurm("n0 n1 n2")
    assert done.returncode == 0, done.stderr
    steps = [shlex.split(line) for line in done.stdout.splitlines()]
    assert [s[0] for s in steps] == ["srun"] * 4
    roles = {}
    for step in steps:
        argv = step[step.index("asyncrl") + 1:]
        args = _parser().parse_args(argv)  # exits (fails the test) on a bad command line
        roles.setdefault(args.command, []).append((step, args))
    assert sorted(roles) == ["buffer", "learner", "rollout"]
    (buffer_step, buffer), = roles["buffer"]
    assert "--nodelist=n0" in buffer_step and "buffer.zmq.port=5555" in buffer.overrides
    (learner_step, learner), = roles["learner"]
    assert "--nodelist=n0" in learner_step and learner.buffer == "tcp://n0:5555"
    assert all("weights.host=auto" in a.overrides for _, a in roles["learner"] + roles["rollout"])
    fleets = roles["rollout"]
    assert [(a.buffer, a.workers, a.first_index) for _, a in fleets] == \
        [("tcp://n0:5555", 4, 0), ("tcp://n0:5555", 4, 4)]  # disjoint worker indices
    assert all("rollout.workers=8" in a.overrides for _, a in fleets)  # data split over all
    assert ["--nodelist=n1" in s for s, _ in fleets] == [True, False]


def test_slurm_script_refuses_a_single_node():
    done = _dry_run_slurm("n0")
    assert done.returncode == 2 and "at least 2 nodes" in done.stderr


def _up_dry_run(*overrides: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["up", str(QUICKSTART), "--dry-run",
                     *[a for o in overrides for a in ("--set", o)]]) == 0
    return out.getvalue()


def test_up_dry_run_prints_the_local_commands(tmp_path):
    lines = _up_dry_run(f"run.output_dir={tmp_path}").splitlines()
    config = tmp_path / "quickstart" / "config.toml"
    assert lines[0].startswith(f"asyncrl buffer {config} --address-file")
    assert lines[1] == f"asyncrl learner {config} --buffer ADDRESS"
    assert lines[2].endswith("--buffer ADDRESS --workers 2")
    for line in lines:  # each is a command line the CLI accepts
        _parser().parse_args(shlex.split(line)[1:])
    assert not (tmp_path / "quickstart").exists()  # nothing was started or written


def test_up_dry_run_prints_the_ray_placement():
    text = _up_dry_run("launcher.type=ray", "learner.ranks=2", "resources.learner.gpus=1",
                       "rollout.workers=3")
    assert "placement group learner (PACK): 2 x {'CPU': 1.0, 'GPU': 1.0}" in text
    assert text.count("placement group rollout[") == 3
    assert "actor learner[1]: run_learner_rank(rank=1, world=2)" in text


def test_weights_host_auto_is_the_interface_that_reaches_the_buffer():
    from asyncrl.config import load_config
    from asyncrl.net import broadcast_host

    cfg = load_config(None, ["weights.host=auto"])
    assert broadcast_host(cfg, "tcp://127.0.0.1:5555") == "127.0.0.1"
    assert broadcast_host(load_config(None, []), "tcp://10.1.2.3:5555") == "127.0.0.1"
    redis = load_config(None, ["weights.host=auto", "buffer.type=redis",
                               "buffer.redis.url=redis://127.0.0.1:6379/0"])
    assert broadcast_host(redis, None) == "127.0.0.1"
    assert broadcast_host(load_config(None, ["weights.host=10.0.0.7"]), None) == "10.0.0.7"
