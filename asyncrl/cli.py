"""The `asyncrl` command line: one subcommand per role, plus up / monitor / status / config."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.limits import MAX_PROCESSES
from asyncrl.config.load import to_toml
from asyncrl.exits import GROUP_LEFT_EXIT, NO_ANSWER_EXIT, GroupLeft, report_config_error
from asyncrl.launch.preflight import NotRunning, check_startup, import_from_cwd

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def role(name: str, help_: str, config_required: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", type=Path, nargs=None if config_required else "?",
                       help="TOML config file")
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
        return p

    up = role("up", "start buffer, learner and rollout workers (locally or on Ray) and show "
                    "progress")
    up.add_argument("--dry-run", action="store_true",
                    help="run the checks `up` runs first (paths, data rows, ports, imports), "
                         "then print what the launcher (launcher.type) would start; start "
                         "nothing")
    role("buffer", "run the ZMQ broker").add_argument(
        "--address-file", type=Path, help="write the bound address here (for port = 0)")
    learner = role("learner", "run the learner ranks")
    learner.add_argument("--buffer", help="tcp://host:port")
    for flag, key, kind, help_ in _LEARNER_FLAGS:
        learner.add_argument(flag, dest=key, type=kind, help=f"{help_} (learner.{key})")
    for p in (up, learner):
        p.add_argument("--resume", type=Path, metavar="PATH",
                       help="resume from this checkpoint directory (default: the run's latest "
                            "checkpoint when checkpoint.resume is true)")
    rollout = role("rollout", "run rollout workers")
    rollout.add_argument("--buffer", help="tcp://host:port")
    rollout.add_argument("--workers", type=_bounded(1, MAX_PROCESSES),
                         help="workers to start (default rollout.workers)")
    rollout.add_argument("--first-index", type=_bounded(0, MAX_PROCESSES - 1), default=0,
                         help="index of the first worker")
    for name, help_ in (("monitor", "live view of a running run"),
                        ("status", "print a running run's status once")):
        p = role(name, help_, config_required=False)
        p.add_argument("--buffer", help="tcp://host:port (default: from the run directory)")
        p.add_argument("--json", action="store_true", help="raw JSON (status)")
    plot = sub.add_parser("plot", help="write PNG curves of a run (reward, staleness, "
                                       "throughput, idle ratios)")
    plot.add_argument("run_dir", type=Path, help="run directory (holds metrics.jsonl)")
    plot.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/plots)")
    evaluate = role("eval", "run the held-out validation (val/test_score/<task>) on a checkpoint")
    evaluate.add_argument("--checkpoint", type=Path, required=True, metavar="PATH",
                          help="an HF model directory (runs/<name>/final) or a learner "
                               "checkpoint (runs/<name>/checkpoints/step_<V>)")
    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("config", type=Path)
    show.add_argument("--set", dest="overrides", action="append", default=[])
    config_sub.add_parser("reference", help="print every config key as Markdown (the docs' "
                          "configuration reference)")
    return parser


def _bounded(low: int, high: int):
    """An argparse type: an integer in ``[low, high]`` (argparse names the flag if not)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value
    return parse


def buffer_address(cfg: Config, explicit: str | None) -> str | None:
    """--buffer, else the address `asyncrl up` recorded in the run directory, else the config.
    None without a broker process (Redis: ``buffer.redis.url`` is the address)."""
    from buffers.backends import buffer_backend  # lazily: buffers imports numpy

    return buffer_backend(cfg.buffer).dial_address(explicit, cfg.run_dir / "buffer.addr")


def _dispatch(args: argparse.Namespace) -> int:
    from asyncrl.launch import roles

    if args.command == "plot":
        from asyncrl.plot import NothingToPlot, plot_run

        try:
            paths = plot_run(args.run_dir, args.out)
        except NothingToPlot as exc:
            sys.stderr.write(f"asyncrl: plot: {exc}\n")
            return 1
        for path in paths:
            sys.stdout.write(f"{path}\n")
        return 0
    if args.command == "config" and args.config_command == "reference":
        from asyncrl.config.reference import config_reference

        sys.stdout.write(config_reference())
        return 0
    if args.command == "config":
        sys.stdout.write(to_toml(load_config(args.config, args.overrides)))
        return 0
    cfg = load_config(args.config,
                      args.overrides + _resume_override(args) + _learner_overrides(args))
    roles.setup_logging(args.command)
    if args.command == "learner":
        from asyncrl.sinks import check_sinks

        check_sinks(cfg.monitor)  # a missing optional package fails here, not mid-run
    if args.command == "up":
        from asyncrl.launch import make_launcher

        launcher = make_launcher(cfg)
        if args.dry_run:  # the checks `up` runs first (launcher.up calls the same function)
            check_startup(cfg)
            sys.stdout.write("\n".join(launcher.plan()) + "\n")
            return 0
        return launcher.up()
    if args.command == "buffer":
        return _serve_buffer(cfg, args)
    if args.command == "eval":
        from asyncrl.eval_checkpoint import run_eval

        sys.stdout.write(json.dumps(run_eval(cfg, args.checkpoint), indent=2) + "\n")
        return 0
    if args.command in ("monitor", "status"):
        return _observe(cfg, args)
    address = buffer_address(cfg, args.buffer)
    if args.command == "learner":
        return roles.run_learner(cfg, address)
    return roles.run_rollout(cfg, address, args.workers or cfg.rollout.workers,
                             args.first_index)


# torchrun-style flags of `asyncrl learner`: each is a --set of the learner section, so a node's
# topology is also visible in `asyncrl config show` and validated with the config.
_LEARNER_FLAGS = (
    ("--nnodes", "nnodes", int, "learner nodes in the job"),
    ("--node-rank", "node_rank", int, "this node's index, 0 .. nnodes-1"),
    ("--nproc-per-node", "ranks", int, "training ranks on this node"),
    ("--master-addr", "master_addr", str, "host of global rank 0's rendezvous"),
    ("--master-port", "master_port", int, "rendezvous port, the same on every node"),
)


def _learner_overrides(args: argparse.Namespace) -> list[str]:
    """The torchrun-style flags given, as ``learner.KEY=VALUE`` overrides."""
    out = []
    for _, key, _, _ in _LEARNER_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            out.append(f"learner.{key}={json.dumps(value)}")
    return out


def _resume_override(args: argparse.Namespace) -> list[str]:
    """``--resume PATH`` is ``checkpoint.path``: it then travels in the run's config.toml from
    `up` to the learner it starts."""
    path = getattr(args, "resume", None)
    return [f"checkpoint.path={json.dumps(str(path.resolve()))}"] if path else []


def _serve_buffer(cfg: Config, args: argparse.Namespace) -> int:
    """`asyncrl buffer`: the broker process of a backend that has one."""
    from asyncrl.launch import roles
    from buffers.backends import buffer_backend

    backend = buffer_backend(cfg.buffer)
    if not backend.broker:
        raise ConfigError(f"buffer.type = {cfg.buffer.type!r}: {backend.no_broker}")
    return roles.serve_buffer(cfg, args.address_file)


def _observe(cfg: Config, args: argparse.Namespace) -> int:
    from asyncrl.monitor import make_view, print_status, watch
    from asyncrl.launch.preflight import check_broker
    from asyncrl.launch.signals import stop_on_signals
    from buffers import connect_buffer
    from buffers.backends import buffer_backend

    address = buffer_address(cfg, args.buffer)
    buffer_backend(cfg.buffer).preflight()  # a server no role starts (Redis) answers
    if address is not None:
        check_broker(address, cfg.run.name)
    client = connect_buffer(cfg, address)
    try:
        if args.command == "monitor":
            view = make_view(cfg.monitor, sys.stdout, cfg.run_dir, lines=False)
            watch(client, view, cfg.launcher.refresh_s / 2, stop_on_signals())
            return 0
        status = client.status()
        if args.json:
            sys.stdout.write(json.dumps(status, indent=2) + "\n")
        else:
            print_status(status, cfg.monitor, cfg.run_dir)
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import_from_cwd()
    try:
        return _dispatch(args)
    except ConfigError as exc:
        return report_config_error(exc)
    except NotRunning as exc:
        sys.stderr.write(f"asyncrl: {exc}\n")
        return 1
    except TimeoutError as exc:
        sys.stderr.write(f"asyncrl: {exc}\n")
        return NO_ANSWER_EXIT
    except GroupLeft as exc:  # a node's only learner rank, another node's rank gone
        sys.stderr.write(f"asyncrl: {exc}\n")
        return GROUP_LEFT_EXIT


if __name__ == "__main__":
    sys.exit(main())
