"""Only the factories know a backend's name; everything else asks its descriptor.

The buffer backends (:mod:`buffers.backends`) and the engine kinds (:mod:`asyncrl.engine_kinds`)
each answer what the launchers, the command line, the config and the learner need to know. A
test of ``buffer.type``, ``rollout.engine`` or ``weights.transport`` against a name anywhere
else is how backend knowledge leaked out before; the scan below fails naming its file:line.
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from asyncrl.config import BufferConfig, ConfigError, RolloutConfig, load_config
from asyncrl.config.load import to_toml
from asyncrl.engine_kinds import ENGINE_KINDS, engine_kind
from buffers.backends import RedisBackend, ZmqBackend, buffer_backend

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "buffers", "learners", "rollouters")
FACTORIES = {
    "asyncrl/engine_kinds.py": "the engine kinds, by name",
    "buffers/backends.py": "buffer_backend: the buffer backends, by name",
    "rollouters/engines/__init__.py": "make_engine: builds the engine a kind names",
    "asyncrl/weights/transport.py": "transport_class: the weight transports, by name",
    "learners/backends/__init__.py": "make_trainer: the learner backends, by name",
}
SELECTORS = {"engine", "transport"}  # attributes or variables holding a backend's name


# --- the scan ---------------------------------------------------------------------------------

def _is_selector(node: ast.expr) -> bool:
    """``x.engine``, ``engine``, ``x.transport``, ``transport``, ``x.buffer.type``,
    ``buffer.type``: an expression that holds a backend's name."""
    if isinstance(node, ast.Attribute):
        if node.attr in SELECTORS:
            return True
        owner = node.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        return node.attr == "type" and owner_name == "buffer"
    return isinstance(node, ast.Name) and node.id in SELECTORS


def _names(node: ast.expr, constants: dict[str, ast.expr]) -> bool:
    """A string literal, a tuple/list/set/dict of them, or a module constant bound to one."""
    if isinstance(node, ast.Name) and node.id in constants:
        node = constants[node.id]
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_names(e, constants) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys) and all(k is not None and _names(k, constants) for k in node.keys)
    return False


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = <literal>`` (``ADAPTER_ENGINES = ("torch",)``)."""
    found = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 \
            else getattr(node, "target", None) if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and node.value is not None:
            found[target.id] = node.value
    return found


def name_tests(source: str, filename: str = "<source>") -> Iterator[tuple[int, str]]:
    """``(line, code)`` for every test of a backend's name in ``source``: a comparison
    (``==``, ``!=``, ``in``, ``not in``) of a selector with names, a dict of names indexed by
    one, a ``match`` on one with a name as a case."""
    tree = ast.parse(source, filename)
    constants = _module_constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            pairs = [*zip(sides, sides[1:]), *zip(sides[1:], sides)]
            if any(_is_selector(a) and _names(b, constants) for a, b in pairs):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Subscript) and _is_selector(node.slice) \
                and _names(node.value, constants):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Match) and _is_selector(node.subject) and any(
                isinstance(case.pattern, ast.MatchValue) and _names(case.pattern.value, constants)
                for case in node.cases):
            yield node.lineno, f"match {ast.unparse(node.subject)}"


def test_no_code_outside_the_factories_tests_a_backend_name() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in FACTORIES:
                continue
            found += [f"{rel}:{line}: {code}" for line, code
                      in sorted(name_tests(path.read_text(encoding="utf-8"), rel))]
    assert not found, ("backend names tested outside the factories (ask the descriptor: "
                       "buffers.backends.buffer_backend, asyncrl.engine_kinds.engine_kind):\n"
                       + "\n".join(found))


def test_the_factories_exist() -> None:
    """A stale entry would exempt a module of that name unnoticed."""
    assert sorted(f for f in FACTORIES if not (ROOT / f).is_file()) == []


def test_the_scan_finds_each_way_of_testing_a_name() -> None:
    source = '''
ADAPTER_ENGINES = ("torch",)
KINDS = {"sglang": 1}
def f(cfg, c, engine, self):
    a = cfg.buffer.type == "redis"
    b = "zmq" != c.buffer.type
    d = cfg.rollout.engine in ADAPTER_ENGINES
    e = 1 if engine == "sglang" else 16
    g = self.engine not in ("vllm-server", "sim")
    h = KINDS[cfg.rollout.engine]
    i = cfg.weights.transport == "gloo"
    match cfg.rollout.engine:
        case "sim":
            pass
'''
    assert sorted(line for line, _ in name_tests(source)) == [5, 6, 7, 8, 9, 10, 11, 12]


def test_the_scan_leaves_other_comparisons_alone() -> None:
    source = '''
def f(cfg, scheme, kind):
    a = scheme not in ("redis", "rediss", "unix")
    b = cfg.workflow.type == "digits"
    c = cfg.rollout.engine == kind
    d = engine_kind(cfg.rollout.engine).threads
    e = cfg.device.type == "cuda"
'''
    assert list(name_tests(source)) == []


# --- the engine kinds -------------------------------------------------------------------------

def test_every_engine_choice_has_one_kind_and_no_more() -> None:
    choices = typing.get_args(RolloutConfig.model_fields["engine"].annotation)
    assert tuple(ENGINE_KINDS) == choices
    assert all(kind.name == name for name, kind in ENGINE_KINDS.items())


def test_each_engine_kind_answers() -> None:
    torch, vllm, server, sglang, sim = (engine_kind(n) for n in
                                        ("torch", "vllm", "vllm-server", "sglang", "sim"))
    assert [k.name for k in ENGINE_KINDS.values() if k.merges_adapters] == ["torch"]
    assert [k.name for k in ENGINE_KINDS.values() if k.needs_url] == []  # all can launch
    assert [k.name for k in ENGINE_KINDS.values() if k.threads] == ["sim"]
    assert [k.name for k in ENGINE_KINDS.values() if k.packs_every_tensor] == ["sglang"]
    assert sglang.bucket_align == 1 and torch.bucket_align is None and sim.bucket_align is None
    assert (vllm.table, sglang.table, server.table, torch.table) == \
        ("vllm", "sglang", "vllm", None)


def test_an_engine_kind_reads_a_sub_table_that_exists() -> None:
    tables = {name for name, info in RolloutConfig.model_fields.items()
              if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
    assert {k.table for k in ENGINE_KINDS.values()} - {None} == tables


def test_an_unknown_engine_kind_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown rollout.engine 'tgi' \(torch, vllm, "
                                         r"vllm-server, sglang, sim\)"):
        engine_kind("tgi")


def test_a_vllm_server_fleet_is_attached_or_launched() -> None:
    """With ``rollout.url`` the workers attach to it; without, each launches its own server."""
    assert load_config(None, ["rollout.engine='vllm-server'"]).rollout.url == ""
    assert load_config(None, ["rollout.engine='vllm-server'", "rollout.url='http://h:8000'",
                              "rollout.workers=1"]).rollout.url == "http://h:8000"


def test_the_vllm_table_is_read_by_both_vllm_kinds(caplog: pytest.LogCaptureFixture) -> None:
    """``[rollout.vllm]`` belongs to both vLLM kinds (vllm-server reads its sampling keys, and
    its serving keys for the servers it launches): no warning, and the rendered config keeps
    it; a torch run is told it is ignored."""
    overrides = ["rollout.engine='vllm-server'", "rollout.url='http://h:8000'",
                 "rollout.workers=1", "rollout.vllm.enforce_eager=false"]
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.resolve"):
        cfg = load_config(None, overrides)
    assert caplog.records == []
    text = to_toml(cfg)
    assert "[rollout.vllm]" in text and "[rollout.sglang]" not in text
    assert "[rollout.vllm]" in to_toml(load_config(None, ["rollout.engine='vllm'"]))


# --- the buffer backends ----------------------------------------------------------------------

def test_every_buffer_type_has_a_backend() -> None:
    choices = typing.get_args(BufferConfig.model_fields["type"].annotation)
    backends = {name: buffer_backend(BufferConfig(type=name)) for name in choices}
    assert {name: type(b) for name, b in backends.items()} == {"zmq": ZmqBackend,
                                                              "redis": RedisBackend}
    assert all(b.config.type == name for name, b in backends.items())


def test_an_unknown_buffer_type_is_refused() -> None:
    config = BufferConfig().model_copy(update={"type": "kafka"})  # past validation
    with pytest.raises(ValueError, match="buffer.type: unknown backend 'kafka'"):
        buffer_backend(config)


def test_the_zmq_backend_has_a_broker_the_roles_dial(tmp_path: Path) -> None:
    backend = buffer_backend(load_config(None, ["buffer.zmq.host='10.0.0.2'",
                                                "buffer.zmq.port=6000"]).buffer)
    assert backend.broker and backend.no_broker == ""
    recorded = tmp_path / "buffer.addr"
    assert backend.dial_address(None, recorded) == "tcp://10.0.0.2:6000"  # the config
    recorded.write_text("tcp://127.0.0.1:7000\n")
    assert backend.dial_address(None, recorded) == "tcp://127.0.0.1:7000"  # what up recorded
    assert backend.dial_address("tcp://h:8000", recorded) == "tcp://h:8000"  # --buffer
    with pytest.raises(ConfigError, match=r"^--buffer: 'h:8000' is not a broker address"):
        backend.dial_address("h:8000", recorded)
    free = buffer_backend(load_config(None, ["buffer.zmq.port=0"]).buffer)
    with pytest.raises(ConfigError, match="buffer.zmq.port is 0"):
        free.dial_address(None, tmp_path / "none.addr")


def test_the_zmq_backend_leaves_the_run_to_its_broker(tmp_path: Path) -> None:
    backend = buffer_backend(BufferConfig())
    assert backend.start_run("r", resuming=False) is None and backend.preflight() is None
    assert list(tmp_path.iterdir()) == []
    assert backend.earlier_run_hint(tmp_path) == \
        f"move its spill file {tmp_path / 'buffer.spill'} aside"
    memory_only = buffer_backend(load_config(None, ["buffer.zmq.spill_path=''"]).buffer)
    assert memory_only.earlier_run_hint(tmp_path) == "restart the broker"


def test_the_redis_backend_is_its_own_broker(tmp_path: Path) -> None:
    backend = buffer_backend(load_config(None, ["buffer.type='redis'"]).buffer)
    assert not backend.broker
    assert backend.no_broker.startswith("Redis is the broker, there is no `asyncrl buffer`")
    (tmp_path / "buffer.addr").write_text("tcp://127.0.0.1:7000")
    assert backend.dial_address("tcp://h:8000", tmp_path / "buffer.addr") is None
    assert backend.earlier_run_hint(tmp_path) == \
        "clear the run's Redis keys, as a fresh `asyncrl up` does"
    with pytest.raises(ValueError, match="needs groups_per_step"):
        backend.client(None, run_id="r", groups_per_step=None, stop=None)


def test_asyncrl_buffer_without_a_broker_process_is_a_config_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "buffer",
                           str(ROOT / "configs" / "quickstart.toml"), "--set", "buffer.type=redis",
                           "--set", "buffer.zmq.port=5555", "--set", f"run.output_dir={tmp_path}"],
                          cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("asyncrl: buffer.type = 'redis': Redis is the broker, there is no "
                           "`asyncrl buffer` process to run; point the roles at "
                           "buffer.redis.url\n")
