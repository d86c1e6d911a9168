"""Where the ZMQ broker's main thread spends its CPU, with real sockets and real clients.

Runs ``bench/buffer_throughput.py``'s ``zmq-put-many`` row (4 producer processes of
``put_many`` of 8 groups, the consumer with ``--take-depth`` batch requests in flight), with the
broker's socket wrapped so each of its calls is timed in the broker's main thread
(``time.thread_time``): ``poll``, ``recv_multipart``, ``send_multipart`` (or the
``buffers.zmq_frames`` functions that replaced them); the request
handlers' own time (``_handle`` less the sends inside it), and the housekeeping. Prints µs of
main-thread CPU per group moved, and the row's MB/s.

    .venv/bin/python bench/results/broker-split/broker_split.py [--tokens 1024] \
        [--producers 4] [--seconds 5] [--take-depth 4] [--max-groups 256] \
        [--put-depth 1] [--spill-dir DIR] [CODE_ROOT]

With ``--spill-dir`` the broker journals to a spill file there, and the spill file's appends
(every record) and its ``writev`` calls are timed too, in CPU and in wall time.

``CODE_ROOT`` (default: this checkout) goes first on ``sys.path``, so that a ``git archive``
copy of another commit can be measured with the same script. ``BROKER_SPLIT_PROF=FILE`` also
runs the broker under cProfile and dumps its stats to FILE (slower: for the shape, not the
figures).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


class TimedSocket:
    """Delegates to a zmq socket, adding each timed call's main-thread CPU to ``spent``."""

    def __init__(self, socket: Any, spent: dict[str, float]) -> None:
        self._socket, self._spent = socket, spent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)

    def _timed(self, name: str, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return getattr(self._socket, name)(*args, **kwargs)
        finally:
            self._spent[name] += time.thread_time() - start

    def poll(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("poll", *args, **kwargs)

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("recv_multipart", *args, **kwargs)

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("send_multipart", *args, **kwargs)


def split_broker(spec: Any, address_queue: Any, stop: Any) -> None:
    """The benchmark's broker process, its main thread's time split by call."""
    from asyncrl.config.schema import BufferConfig
    from buffers.zmq_broker import ZmqBroker

    spill = f"{spec.spill_dir}/split-{os.getpid()}.spill" if spec.spill_dir else ""
    config = BufferConfig(port=0, max_staleness=10**9, max_groups=spec.max_groups,
                          reclaim_idle_s=600.0, io_threads=spec.io_threads, spill_path=spill)
    broker = ZmqBroker(config, groups_per_step=1, run_id="")
    address = broker.bind()
    spent: dict[str, float] = defaultdict(float)
    broker._socket = TimedSocket(broker._socket, spent)
    from buffers import zmq_broker
    for name, label in (("recv_frames", "recv_multipart"), ("send_frames", "send_multipart")):
        if hasattr(zmq_broker, name):  # the broker calls them with its socket (the wrapper)
            function = getattr(zmq_broker, name)

            def timed_io(socket: Any, *args: Any, _function: Any = function,
                         _label: str = label) -> Any:
                start = time.thread_time()
                try:
                    return _function(socket._socket, *args)
                finally:
                    spent[_label] += time.thread_time() - start
            setattr(zmq_broker, name, timed_io)
    for name in ("_handle", "_housekeeping"):
        method = getattr(broker, name)

        def timed(*args: Any, _method: Any = method, _name: str = name) -> Any:
            start = time.thread_time()
            try:
                return _method(*args)
            finally:
                spent[_name] += time.thread_time() - start
        setattr(broker, name, timed)
    journal = broker.state.journal
    if journal is not None:   # the spill file's appends (every record), and the writes alone
        from buffers import zmq_spill

        for owner, name, label in ((journal, "_append", "spill append"),
                                   (zmq_spill, "write_all", "spill writev")):
            function = getattr(owner, name)

            def timed_spill(*args: Any, _function: Any = function, _label: str = label) -> Any:
                start, wall = time.thread_time(), time.perf_counter()
                try:
                    return _function(*args)
                finally:
                    spent[_label] += time.thread_time() - start
                    spent[f"{_label} (wall)"] += time.perf_counter() - wall
            setattr(owner, name, timed_spill)
    for command, handler in list(broker._handlers.items()):
        def timed_handler(request: Any, _handler: Any = handler, _name: str = command) -> Any:
            start = time.thread_time()
            try:
                return _handler(request)
            finally:
                spent["command " + _name] += time.thread_time() - start
                spent["count " + _name] += 1
        broker._handlers[command] = timed_handler
    from buffers import group_check
    scan = group_check._groupscan.check

    class TimedScan:
        GroupError = group_check._groupscan.GroupError

        @staticmethod
        def check(*args: Any) -> Any:
            start = time.thread_time()
            try:
                return scan(*args)
            finally:
                spent["C check"] += time.thread_time() - start
    group_check._groupscan = TimedScan
    address_queue.put(address)
    profile = (cProfile.Profile(time.thread_time) if os.environ.get("BROKER_SPLIT_PROF")
               else None)  # CPU time: on 2 cores a send often loses the core for a while
    start = time.thread_time()
    try:
        if profile is not None:
            profile.runcall(broker.serve, stop)
        else:
            broker.serve(stop)
    finally:
        if profile is not None:
            profile.dump_stats(os.environ["BROKER_SPLIT_PROF"])
        spent["total"] = time.thread_time() - start
        spent["accepted"] = broker.state.accepted
        Path(os.environ["BROKER_SPLIT_OUT"]).write_text(json.dumps(spent))
        broker.close()
        if spill:
            Path(spill).unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("code_root", nargs="?", default=str(ROOT))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--take-depth", type=int, default=4)
    parser.add_argument("--max-groups", type=int, default=256)
    parser.add_argument("--spill-dir", default="", help="journal to a spill file there")
    parser.add_argument("--put-depth", type=int, default=1,
                        help="each producer's put_many calls in flight (PutAhead)")
    args = parser.parse_args()
    sys.path.insert(0, args.code_root)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [args.code_root, str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(ROOT / "bench"))
    import buffer_throughput as bt

    bt._zmq_broker = split_broker
    out = Path(tempfile.mkdtemp()) / "split.json"
    os.environ["BROKER_SPLIT_OUT"] = str(out)
    spec = bt.Spec(tokens=args.tokens, samples=8, batch=8, max_groups=args.max_groups,
                   redis_url="", put_many=8, take_depth=args.take_depth,
                   spill_dir=args.spill_dir, put_depth=args.put_depth)
    rate, cpu = bt.bench_zmq(mp.get_context("spawn"), spec, args.producers, args.seconds)
    spent = json.loads(out.read_text())
    groups = spent.pop("accepted")
    handlers = spent["_handle"] - spent["send_multipart"]  # sends happen inside handlers
    # (and in the housekeeping's expiries: none in this row, whose waits are answered early)
    rows = {"poll": spent["poll"], "recv_multipart": spent["recv_multipart"],
            "send_multipart": spent["send_multipart"], "handlers (less sends)": handlers,
            "housekeeping": spent["_housekeeping"],
            "rest of the loop": spent["total"] - spent["poll"] - spent["recv_multipart"]
            - spent["_handle"] - spent["_housekeeping"], "total": spent["total"]}
    rows.update({k: v for k, v in spent.items()
                 if k.startswith(("command ", "C check", "spill "))})
    mb = rate * bt.group_bytes(spec) / 1e6
    print(f"{args.tokens} tokens, {args.producers} producers, take depth {args.take_depth}: "
          f"{rate:,.0f} groups/s, {mb:,.0f} MB/s; broker main thread "
          f"{cpu.get('server-main', 0):.2f} cores; {groups} groups accepted in all")
    for name, count in spent.items():
        if name.startswith("count "):
            print(f"  {name:24s} {count / groups:7.3f} per group")
    for name, seconds in rows.items():
        print(f"  {name:24s} {seconds * 1e6 / groups:7.1f} µs/group")


if __name__ == "__main__":
    main()
