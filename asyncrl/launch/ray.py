"""`asyncrl up` with ``launcher.type = "ray"``: the roles as Ray actors in placement groups.

Each learner rank and each rollout worker is one actor in its own placement-group bundle sized
by ``resources.learner`` / ``resources.rollout`` (learner ranks in one group, packed; each rollout
worker in a group of its own, so a restarted worker takes its predecessor's reservation back).
The actors run the same per-process entry points the CLI roles run
(:func:`learners.loop.run_learner_rank`, :func:`rollouters.worker.run_rollout_worker`, the ZMQ
broker), each with a stop event the driver sets, so shutdown is the same ordered, graceful stop
as the local launcher's: learner first (it saves), then the rollout fleet, then the broker. Role
logs reach the driver through Ray's log streaming, prefixed with the role's name.

Failures follow the local launcher's contract too:
:func:`~asyncrl.launch.preflight.check_startup` runs before Ray is even imported (a bad path,
plugin or Redis URL: exit 2, nothing started), a crashed rollout worker is restarted by the same
policy (:mod:`asyncrl.launch.restart`), and a role that stops on a
:class:`~asyncrl.config.ConfigError` is never restarted: the run stops with exit status
:data:`~asyncrl.exits.CONFIG_ERROR_EXIT` and the error in one line. A second Ctrl-C
kills the actors still stopping, as with the local launcher.

Ray is imported only here, and only when this launcher is used.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asyncrl.config import Config, ConfigError
from asyncrl.launch.actor_paths import for_actors, python_path
from asyncrl.launch.preflight import check_startup
from asyncrl.launch.restart import Restarts, RestartPolicy, RoleFailed
from asyncrl.launch.run_dir import (is_resuming, print_final, reopen_run, run_dir_note,
                                    status_client, write_run_dir)
from asyncrl.launch.signals import LauncherSignals, say_learner_stops
from asyncrl.monitor import make_view
from buffers.backends import buffer_backend
from buffers.run_token import TOKEN_ENV, ensure_token

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


class RoleActor:
    """One role process on the cluster. Two threads: one runs the role, one may stop it."""

    def __init__(self, name: str) -> None:
        from asyncrl.launch.roles import setup_logging

        self.name = name
        self.stop = threading.Event()
        self.broker: Any = None
        self.reserved_port: Any = None  # rank 0's actor: the rendezvous port
        setup_logging(name)

    def __repr__(self) -> str:  # Ray prefixes streamed log lines with this
        return self.name

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def reserve_port(self) -> int:
        """A port for the learners' rendezvous, held from other processes for the life of
        this actor, rank 0's, which binds it (:class:`asyncrl.net.ReservedPort`)."""
        from asyncrl.net import ReservedPort

        self.reserved_port = ReservedPort()
        return self.reserved_port.port

    def bind_buffer(self, cfg: Config) -> str:
        from buffers.run_token import ensure_token
        from buffers.zmq_broker import ZmqBroker

        self.broker = ZmqBroker(cfg.buffer, cfg.learner.groups_per_step, run_id=cfg.run.name,
                                run_dir=cfg.run_dir, token=ensure_token(cfg.run_dir))
        address = self.broker.bind()
        if cfg.buffer.zmq.host in ("0.0.0.0", "*", ""):  # bound everywhere: dial this node's IP
            address = f"tcp://{self.node_ip()}:{address.rsplit(':', 1)[1]}"
        return address

    def serve_buffer(self) -> None:
        try:
            self.broker.serve(self.stop)
        finally:
            self.broker.close()

    def run_learner(self, cfg: Config, rank: int, world: int, address: str | None,
                    master_addr: str, master_port: int) -> None:
        from learners.loop import run_learner_rank
        from rollouters.eval import EngineEvaluator

        learner = cfg.learner.model_copy(update={"master_addr": master_addr})
        run_learner_rank(cfg.model_copy(update={"learner": learner}), rank, world, address,
                         master_port, self.stop, evaluator=EngineEvaluator)

    def run_rollout(self, cfg: Config, index: int, address: str | None) -> None:
        from rollouters.worker import run_rollout_worker

        run_rollout_worker(cfg, index, address, self.stop)

    def request_stop(self) -> None:
        self.stop.set()


@dataclass(frozen=True)
class _Failure:
    """How a role's call ended in error: the error in one line, and whether it was a
    configuration error (never restarted: the same config fails the same way)."""

    text: str
    config_error: bool = False


@dataclass
class _Placed:
    """A running actor, the call that runs its role, where it is placed, and when it restarts
    (learners and the broker never: a crash of one ends the run)."""

    name: str
    actor: Any
    ref: Any
    bundle: Any  # (placement group, bundle index)
    restarts: Restarts


class RayLauncher:
    """Starts and supervises the roles on a Ray cluster; same contract as LocalLauncher."""

    def __init__(self, cfg: Config, out: IO[str] = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.signals = LauncherSignals()
        self.stop = self.signals.stop
        self.policy = RestartPolicy.from_config(cfg.launcher)
        self.buffer: _Placed | None = None
        self.learners: list[_Placed] = []
        self.rollouts: list[_Placed] = []
        self.groups: list[Any] = []
        self._learner_group: Any = None  # launcher.colocate: the rollout workers join it
        self.address: str | None = None

    def plan(self) -> list[str]:
        """What `up` would place, one line each (``asyncrl up --dry-run``)."""
        c, r = self.cfg, self.cfg.resources
        lines = [f"ray.init(address={c.launcher.address or 'a private local cluster'!r})"]
        if buffer_backend(c.buffer).broker:
            lines.append(f"actor buffer: ZMQ broker on {c.buffer.zmq.host}:{c.buffer.zmq.port} "
                         f"(num_cpus={r.buffer.cpus}, num_gpus={r.buffer.gpus})")
        world = c.learner.nnodes * c.learner.ranks
        lines.append(f"placement group learner (PACK): {world} x "
                     f"{_bundle(self._learner_bundle())}")
        lines += [f"actor learner[{i}]: run_learner_rank(rank={i}, world={world})"
                  for i in range(world)]
        for i in range(c.rollout.workers):
            where = (f"learner bundle {i % world} (launcher.colocate)" if c.launcher.colocate
                     else f"placement group rollout[{i}]: 1 x {_bundle(r.rollout)}")
            lines.append(f"{where}; actor rollout[{i}]: run_rollout_worker(index={i}, engine="
                         f"{c.rollout.engine!r})")
        return lines

    def _learner_bundle(self) -> Any:
        """One learner rank's bundle; colocated, it holds the rollout workers that share the
        rank's devices too (worker i goes to bundle i mod world)."""
        c, r = self.cfg, self.cfg.resources
        if not c.launcher.colocate:
            return r.learner
        world = c.learner.nnodes * c.learner.ranks
        per_rank = -(-c.rollout.workers // world)
        return r.learner.model_copy(update={"cpus": r.learner.cpus + per_rank * r.rollout.cpus,
                                            "gpus": r.learner.gpus + per_rank * r.rollout.gpus})

    def up(self) -> int:
        """Run to completion (or until a signal): 0, 130 on a signal, 1 when a role failed for
        good, 2 when one stopped on a config error. Raises :class:`ConfigError` before Ray
        starts for what :func:`check_startup` can check from here."""
        check_startup(self.cfg)
        self.cfg = for_actors(self.cfg, Path.cwd())  # actors run elsewhere (see actor_paths)
        address = self.cfg.launcher.address
        if not address or address.split(":")[0] in ("127.0.0.1", "localhost"):
            # Ray replaces a loopback address with the machine's external one unless this is
            # set (read at import): a private or loopback cluster stays on 127.0.0.1.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        resuming = is_resuming(self.cfg)
        write_run_dir(self.cfg, resuming)
        self._init_ray(ray)
        self.signals.install()
        show_final = True  # not for a run a config error stopped, as with the local launcher
        try:
            self.address = self._start_buffer(ray, resuming)
            if resuming:
                reopen_run(self.cfg, self.address)
            self._start_learners(ray)
            self.rollouts = [self._start_rollout(ray, i) for i in range(self.cfg.rollout.workers)]
            return self._supervise(ray)
        except RoleFailed as exc:
            show_final = not exc.config_error
            return exc.report(self.out)
        finally:
            self.shutdown(ray)
            ray.shutdown()
            if show_final:
                self._print_final()

    # --- start --------------------------------------------------------------------------------

    def _init_ray(self, ray: Any) -> None:
        """Join ``launcher.address``, or start a private single-node cluster kept small (no
        dashboard, a 256 MB object store: the roles pass no data through it)."""
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), python_path(
                   Path.cwd(), os.environ.get("PYTHONPATH"))]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "ASYNCRL_LOG_LEVEL": os.environ.get("ASYNCRL_LOG_LEVEL", "INFO")}
        for key in ("HF_HUB_OFFLINE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
            if key in os.environ:
                env[key] = os.environ[key]
        env[TOKEN_ENV] = ensure_token(self.cfg.run_dir)  # actors may not see the run dir
        kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": True,
                                  "include_dashboard": False, "configure_logging": False}
        if self.cfg.launcher.address:
            kwargs["address"] = self.cfg.launcher.address
        else:  # logical CPUs: as many as the roles ask for, whatever the machine has
            kwargs.update(object_store_memory=256 << 20, _node_ip_address="127.0.0.1",
                          num_cpus=max(os.cpu_count() or 1, math.ceil(self._needed("cpus"))))
        context = ray.init(**kwargs)
        logger.info("ray cluster %s: %s", context.address_info.get("address"),
                    ray.cluster_resources())

    def _needed(self, kind: str) -> float:
        r, c = self.cfg.resources, self.cfg
        return (getattr(r.buffer, kind) * buffer_backend(c.buffer).broker
                + getattr(r.learner, kind) * c.learner.nnodes * c.learner.ranks
                + getattr(r.rollout, kind) * c.rollout.workers)

    def _actor(self, ray: Any, name: str, resources: Any, bundle: Any = None) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {"num_cpus": resources.cpus, "num_gpus": resources.gpus,
                                   "max_concurrency": 2, "name": None}
        if bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=bundle[0], placement_group_bundle_index=bundle[1])
        return ray.remote(RoleActor).options(**options).remote(name)

    def _placement_group(self, ray: Any, name: str, count: int, resources: Any,
                         strategy: str) -> Any:
        from ray.util.placement_group import placement_group

        pg = placement_group([_bundle(resources)] * count, strategy=strategy)
        self.groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RoleFailed(f"{name}: the cluster cannot place {count} x {_bundle(resources)} "
                             f"within {PLACEMENT_TIMEOUT_S:.0f}s (resources.{name.split('[')[0]}; "
                             f"the cluster has {_totals(ray.cluster_resources())}, "
                             f"{_totals(ray.available_resources())} free)") from None
        return pg

    def _start_buffer(self, ray: Any, resuming: bool) -> str | None:
        backend = buffer_backend(self.cfg.buffer)
        backend.start_run(self.cfg.run.name, resuming)
        if not backend.broker:  # Redis: the server is the broker
            return None
        actor = self._actor(ray, "buffer", self.cfg.resources.buffer)
        address = ray.get(actor.bind_buffer.remote(self.cfg))
        self.buffer = _Placed("buffer", actor, actor.serve_buffer.remote(), None,
                              Restarts("buffer"))
        (self.cfg.run_dir / "buffer.addr").write_text(address)  # for status / monitor / joins
        logger.info("buffer broker at %s", address)
        return address

    def _start_learners(self, ray: Any) -> None:
        world = self.cfg.learner.nnodes * self.cfg.learner.ranks  # Ray places every rank
        pg = self._placement_group(ray, "learner", world, self._learner_bundle(), "PACK")
        self._learner_group = pg
        actors = [self._actor(ray, f"learner[{rank}]", self.cfg.resources.learner, (pg, rank))
                  for rank in range(world)]
        master_addr = ray.get(actors[0].node_ip.remote())
        port = self.cfg.learner.master_port or ray.get(actors[0].reserve_port.remote())
        self.learners = [_Placed(f"learner[{rank}]", actor, actor.run_learner.remote(
            self.cfg, rank, world, self.address, master_addr, port), (pg, rank),
            Restarts(f"learner[{rank}]")) for rank, actor in enumerate(actors)]

    def _start_rollout(self, ray: Any, index: int, bundle: Any = None,
                       restarts: Restarts | None = None) -> _Placed:
        """Place rollout worker ``index``: in a placement group of its own, or, restarted, in
        its predecessor's ``bundle`` and on its ``restarts``."""
        name = f"rollout[{index}]"
        if bundle is None and self.cfg.launcher.colocate:  # the devices of a learner rank
            bundle = (self._learner_group, index % len(self.learners))
        if bundle is None:
            bundle = (self._placement_group(ray, name, 1, self.cfg.resources.rollout,
                                            "STRICT_PACK"), 0)
        actor = self._actor(ray, name, self.cfg.resources.rollout, bundle)
        restarts = restarts or Restarts(name, self.policy)
        restarts.started()
        return _Placed(name, actor, actor.run_rollout.remote(self.cfg, index, self.address),
                       bundle, restarts)

    # --- supervise ------------------------------------------------------------------------------

    def _supervise(self, ray: Any) -> int:
        client = status_client(self.cfg, self.address)
        view = make_view(self.cfg.monitor, self.out, self.cfg.run_dir, lines=True)
        try:
            while not self.stop.is_set():
                if self._tend(ray):
                    return 0
                try:
                    view.show(client.status())
                except TimeoutError as exc:
                    logger.warning("status: %s", exc)
                self.stop.wait(self.cfg.launcher.refresh_s)
            return 130
        finally:
            view.close()
            client.close()

    def _tend(self, ray: Any) -> bool:
        """Check every role once; True when the learners finished. A failed learner or broker
        ends the run (RoleFailed); a failed rollout worker is restarted while its budget lasts."""
        for placed in [*self.learners, *([self.buffer] if self.buffer else [])]:
            self._check(ray, placed)
        if self.buffer is not None and _done(ray, self.buffer.ref):
            raise RoleFailed("buffer stopped while the run was going on")
        for i, placed in enumerate(self.rollouts):
            if placed.restarts.due():
                self.rollouts[i] = self._start_rollout(ray, i, placed.bundle, placed.restarts)
            elif not placed.restarts.waiting:
                self._check(ray, placed)
        return all(_done(ray, p.ref) for p in self.learners)

    def _check(self, ray: Any, placed: _Placed) -> None:
        """If the role's call ended in error: schedule its restart (its actor killed: the
        restart gets a new one in the same bundle), or raise :class:`RoleFailed`."""
        failure = _failure(ray, placed.ref)
        if failure is None:
            return
        refusal = placed.restarts.crashed("failed", failure.text, failure.config_error)
        if refusal is not None:
            raise RoleFailed.refused(refusal, "" if refusal.config_error
                                     else run_dir_note(self.cfg))
        ray.kill(placed.actor, no_restart=True)

    # --- stop -----------------------------------------------------------------------------------

    def shutdown(self, ray: Any) -> None:
        """Learners first (they save), then the rollout fleet, then the broker; each is asked
        to stop, given ``launcher.stop_timeout_s`` (the learners
        ``launcher.learner_stop_timeout_s``; none after a second signal), then killed."""
        for fleet in (self.learners, self.rollouts, [self.buffer] if self.buffer else []):
            live = [p for p in fleet if not p.restarts.waiting]
            for placed in live:
                try:
                    placed.actor.request_stop.remote()
                except Exception as exc:  # noqa: BLE001 - a dead actor: nothing to stop
                    logger.debug("stop %s: %s", placed.name, exc)
            if live:
                self._wait_stopped(ray, [p.ref for p in live], fleet[0].name.split("[")[0])
            for placed in fleet:
                ray.kill(placed.actor, no_restart=True)
        for pg in self.groups:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)

    def _wait_stopped(self, ray: Any, refs: list[Any], role: str) -> None:
        """Give a role's actors their grace to stop (none after a second signal); say so when
        some did not stop in time."""
        grace_s = self.cfg.launcher.stop_grace_s(role)
        if role == "learner" and _pending(ray, refs):
            say_learner_stops(grace_s)
        if self.signals.overran(lambda: not _pending(ray, refs), grace_s):
            logger.warning("%d %s actors did not stop in time: killing them",
                           len(_pending(ray, refs)), role)

    def _print_final(self) -> None:
        print_final(self.cfg, self.out)


def _bundle(resources: Any) -> dict[str, float]:
    bundle = {"CPU": resources.cpus}
    if resources.gpus:
        bundle["GPU"] = resources.gpus
    return bundle


def _totals(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU")}


def _done(ray: Any, ref: Any) -> bool:
    return not _pending(ray, [ref])


def _pending(ray: Any, refs: list[Any]) -> list[Any]:
    """The calls of ``refs`` still running."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    return pending


def _failure(ray: Any, ref: Any) -> _Failure | None:
    """How a finished call failed, or None (still running or succeeded). A role's exception
    reaches the driver as Ray's task error; its ``cause`` is the role's own exception."""
    if not _done(ray, ref):
        return None
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        return _Failure(f"actor died: {str(exc).splitlines()[0][:300]}")
    except Exception as exc:  # noqa: BLE001 - a role's exception, reported in one line
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, ConfigError):  # its message names the key, as `asyncrl: ...`
            return _Failure(str(cause), config_error=True)
        return _Failure(f"{type(cause).__name__}: "
                        f"{str(cause).splitlines()[-1][:300] if str(cause) else ''}")
    return None
