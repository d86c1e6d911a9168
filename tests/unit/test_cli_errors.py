"""User mistakes the CLI reports in one line and at once, as real processes: a bad plugin path
or model path stops `asyncrl up` before any role starts, an unreachable Redis or a finished run
stops `asyncrl status` without waiting out the clients' timeouts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def asyncrl(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)
    return done, time.monotonic() - start


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_up_with_a_bad_env_path_exits_2_before_starting_roles(tmp_path: Path) -> None:
    done, took = asyncrl("up", str(ROOT / "examples" / "agent" / "multi_turn.toml"),
                         "--set", "workflow.env=examples.agent.env:Env",
                         "--set", f"run.output_dir={tmp_path}", "--set", "run.name=fixa-env")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("asyncrl: workflow.env: module 'examples.agent.env' has no "
                                  "attribute 'Env'"), done.stderr
    assert "Traceback" not in done.stderr and "ConfigError" not in done.stderr
    assert not (tmp_path / "fixa-env").exists()  # nothing started, nothing written
    assert took < 30


def test_up_with_a_missing_local_model_path_names_it(tmp_path: Path) -> None:
    done, _ = asyncrl("up", str(QUICKSTART), "--set", "model.path=/nonexistent/model",
                      "--set", f"run.output_dir={tmp_path}", "--set", "run.name=fixa-model")
    assert done.returncode == 2, done.stderr
    assert "model.path: '/nonexistent/model' does not exist" in done.stderr


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_up_with_a_missing_data_path_exits_2_before_starting_anything(
        tmp_path: Path, launcher: str) -> None:
    """On Ray too: the check runs before Ray starts (the cluster address here is a closed
    port: reaching for it would fail otherwise, and slowly)."""
    done, took = asyncrl("up", str(ROOT / "examples" / "agent" / "single_turn.toml"),
                         "--set", "data.path=/nonexistent/train.jsonl",
                         "--set", f"launcher.type={launcher}",
                         "--set", f"launcher.address=127.0.0.1:{closed_port()}",
                         "--set", f"run.output_dir={tmp_path}", "--set", "run.name=fixa-data")
    assert done.returncode == 2, done.stderr
    assert done.stderr == "asyncrl: data.path: '/nonexistent/train.jsonl' does not exist\n"
    assert not (tmp_path / "fixa-data").exists()  # nothing started, nothing written
    assert took < 30


def test_status_of_an_unreachable_redis_names_buffer_url(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    done, took = asyncrl("status", str(QUICKSTART), "--set", "buffer.type=redis",
                         "--set", f"buffer.redis.url={url}", "--set", f"run.output_dir={tmp_path}")
    assert done.returncode == 2, done.stderr
    # the quickstart's [buffer.zmq] port = 0 is not read with Redis, and said so
    ignored, error = done.stderr.splitlines()
    assert ignored == "buffer.zmq.port ignored: buffer.type = 'redis' does not read [buffer.zmq]"
    assert error.startswith(f"asyncrl: buffer.redis.url: '{url}': "), done.stderr
    assert took < 20  # not the client's 30 s of reconnects


def test_status_of_a_finished_run_says_it_is_not_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "fixa-done"
    run_dir.mkdir()
    (run_dir / "buffer.addr").write_text(f"tcp://127.0.0.1:{closed_port()}\n")  # left behind
    done, took = asyncrl("status", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=fixa-done")
    assert done.returncode == 1, done.stderr
    assert "asyncrl: run 'fixa-done' is not running: no buffer broker at tcp://" in done.stderr
    assert took < 20  # not the broker request's 30 s timeout, twice



def test_the_console_script_imports_user_code_from_the_current_directory(tmp_path: Path
                                                                          ) -> None:
    """`asyncrl eval examples/agent/single_turn.toml` from the repository root, as the
    README runs it: its ``reward.path`` (``examples.agent.reward:digit_match``) failed with
    ``No module named 'examples'``, since a console script, unlike the ``python -m`` roles
    that `up` starts, does not have the current directory on ``sys.path``."""
    import os

    from asyncrl.config import load_config
    from asyncrl.models import prepare_model_dir

    script = Path(sys.executable).with_name("asyncrl")   # what `pip install` put there
    if not script.is_file():
        pytest.skip(f"no console script at {script}")
    example = ROOT / "examples" / "agent" / "single_turn.toml"
    model = prepare_model_dir(load_config(example, []).model, tmp_path, 0)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(script), "eval", str(example), "--checkpoint", str(model),
                           "--set", f"run.output_dir={tmp_path}"], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"val/num_prompts/' in done.stdout, done.stdout[-2000:]


def test_ctrl_c_while_up_starts_the_buffer_stops_quietly(tmp_path: Path) -> None:
    """SIGINT as soon as `up` started the broker, before it announced its address: `up`
    used to die with a traceback, ``RuntimeError: buffer did not announce its address``.
    Now it stops what it started and says so in one line (exit 130), nothing left running."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "up", str(QUICKSTART),
                             "--set", f"run.output_dir={tmp_path}"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = []
    for line in proc.stderr:   # the launcher logs each role it starts
        err.append(line)
        if "started buffer" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    stderr = "".join(err) + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    if "learner" not in stderr:   # the signal came before the broker's address
        assert out.strip().endswith("stopped before the buffer started: no run was started")
    pid = int(err[-1].split("(pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):   # the broker it started is gone
        import os
        os.kill(pid, 0)
