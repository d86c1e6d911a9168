"""Weight sync: ``WeightBroadcaster.sync`` against a raw transfer of the same bytes.

``--transport`` picks the carrier: ``gloo`` (CPU, the default), ``ipc`` (learner and engines
on one GPU: CUDA IPC handles, each engine copies device to device) or ``nccl`` (learner on
GPU 0, engine i on GPU i+1: needs 1 + engines GPUs). ``ipc`` and ``nccl`` refuse to start
without CUDA (exit status 2). The raw baseline is a bare broadcast over the same transport's
group for gloo and nccl, and for ipc one ``cudaMemcpy`` (a device-to-device ``copy_``) of the
same buckets per engine in this process: what the IPC path costs above moving the bytes.

This process is learner rank 0 (a real ZMQ broker thread, a real control-plane client); the
engines are receiver processes (``bench/weight_sync.py receiver ...``), each holding a
``TorchEngine`` over the same randomly initialised model and applying every update with
``engine.adopt_weights`` (zero-copy commit, ``--commit adopt``, what rollout workers do) or
``engine.load_weights`` (one copy, ``--commit copy``); that call holds the engine's lock: its
pause. The model is a Qwen2 built in code (default hidden 768, 12 layers, vocab 32000,
untied: ~134M parameters).

For each engine count (1, then 2) and bucket size, one warm-up sync (which also builds the
group), then ``--rounds`` x (one timed sync, one raw round), interleaved so both see the same
load on a shared machine. A raw round is the same buckets as the sync's (same plan, so
``--alone-mb`` applies to both; pre-packed, pre-allocated) broadcast
between the same processes over a bare ``ProcessGroupGloo``, ended by a one-element allreduce
so the learner's clock stops when every engine has the bytes (sync's clock stops at the last
ack). ``ratio`` = raw time / sync time (1.0 = no
protocol overhead). Medians are printed as a markdown table, with the sync's two phases as
the learner sees them (``timing/weight_send``: pack + broadcast every bucket;
``timing/weight_ack``: from the last bucket sent to the last ack, which includes the engines'
apply).

``--malloc-env`` re-runs everything with glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` at 2 GiB. It mattered while the sync allocated fresh bucket buffers
on both sides for every update (glibc served each from a fresh ``mmap``: first-touch page
faults, ~10x slower than a warm copy); the sync now reuses persistent staging and receive
buffers, so the env should change little, and the flag stays to check exactly that.

    python bench/weight_sync.py [--transport gloo|ipc|nccl] [--shape custom|qwen2-0.5b]
                                [--bucket-mb 32 128 512] [--rounds 3] [--engines 1 2]
                                [--commit adopt|copy] [--alone-mb 1] [--malloc-env]
                                [--dtype float32|bfloat16] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.schema import BufferConfig, WeightsConfig, ZmqBufferConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.transport import make_transport, transport_kind
from asyncrl.weights.plan import pack_bucket, plan_buckets
from asyncrl.weights.receiver import WeightReceiver
from asyncrl.weights.rendezvous import dial_store, serve_store
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient

logger = logging.getLogger("bench.weight_sync")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**31 - 1), "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
RAW_KEY = "bench/raw"  # learner → engines: {"store", "epoch", "members", "sizes", "rounds"}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.qwen_shapes import FULL

    torch.manual_seed(0)
    hidden = args.hidden
    shape = dict(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                 num_hidden_layers=args.layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=hidden // 64, tie_word_embeddings=False)
    if args.shape == "qwen2-0.5b":
        shape = dict(FULL)
    config = Qwen2Config(max_position_embeddings=256, **shape)
    return Qwen2ForCausalLM(config).to(args.torch_dtype)


# --- engine process ---------------------------------------------------------------------------

def receiver_main(address: str, member: str, args: argparse.Namespace) -> None:
    """Heartbeat as a rollout member, apply updates into a TorchEngine, serve raw rounds."""
    from rollouters.engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(build_model(args),
                         eos_ids=(0,), pad_id=0, device=engine_device(args, member))
    beats, own = ZmqBufferClient(address, 60.0), ZmqBufferClient(address, 60.0)
    applies: list[float] = []

    def apply(named: dict[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        if args.commit == "adopt":
            engine.adopt_weights(named, version)
        else:
            engine.load_weights(named.items(), version)
        applies.append(time.perf_counter() - start)
        own.set_key(f"bench/apply/{member}", {"apply_s": applies[-1], "version": version})

    receiver = WeightReceiver(own, member, apply, adopt=args.commit == "adopt",
                              device=engine.weights_device)
    receiver.start()
    seq = 0
    while True:
        beats.heartbeat(member, "rollout", {"engine_version": receiver.last_version})
        got = beats.get_key(RAW_KEY, newer_than=seq, timeout_s=1.0)  # paces the heartbeat
        if got is None:
            continue
        seq, raw = got
        if raw.get("stop"):
            break
        if member in raw["members"]:
            serve_raw(raw, raw["members"].index(member) + 1, engine.weights_device)
    receiver.stop()
    beats.close()
    own.close()


def engine_device(args: argparse.Namespace, member: str) -> torch.device:
    """Where engine ``member`` (``engine-<i>``) computes: the CPU for gloo, the learner's GPU
    for ipc, GPU i+1 for nccl (NCCL refuses two ranks on one GPU)."""
    if not transport_kind(args.transport).needs_cuda:
        return torch.device("cpu")
    index = int(member.rsplit("-", 1)[1])
    return torch.device("cuda", index + 1 if args.separate_gpus else 0)


def serve_raw(raw: dict[str, Any], rank: int, device: torch.device) -> None:
    store = dial_store(raw["store"], 120.0)
    transport = make_transport(raw["transport"], host="127.0.0.1", timeout_s=120.0,
                               device=device)
    transport.connect(store, f"raw{raw['epoch']}", rank, len(raw["members"]) + 1)
    device = transport.buffer_device()
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in raw["sizes"]]
    done = torch.zeros(1, device=device)
    for _ in range(raw["rounds"]):
        for flat in buffers:
            transport.receive(flat).wait()
        transport.group.allreduce([done]).wait()
    transport.close()


# --- learner side -----------------------------------------------------------------------------

def spawn(address: str, member: str, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, __file__, "receiver", address, member, *argv],
                            env=env, cwd=ROOT)


def wait_members(control: ZmqBufferClient, count: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    seq = 0
    while time.monotonic() < deadline:
        members = [m for m, e in control.status().get("members", {}).items()
                   if e.get("role") == "rollout" and e.get("alive")]
        if len(members) >= count:
            return
        got = control.get_key("weights/none", newer_than=seq, timeout_s=1.0)  # bounded wait
        seq = got[0] if got else seq
    raise TimeoutError(f"{count} engines did not come up in {timeout_s:.0f}s")


class RawGroup:
    """The baseline of gloo and nccl: the same buckets, pre-packed, over a bare group of the
    same backend with the engines."""

    def __init__(self, control: ZmqBufferClient, state: dict[str, torch.Tensor],
                 bucket_mb: float, rounds: int, members: list[str], epoch: int,
                 alone_mb: float, transport: str) -> None:
        plan = plan_buckets(state, int(bucket_mb * 2**20), alone_bytes=int(alone_mb * 2**20))
        self.buckets = [pack_bucket(plan, i, state).clone() for i in range(len(plan.bucket_nbytes))]
        self.store = serve_store("127.0.0.1", 120.0)
        control.set_key(RAW_KEY, {"store": f"127.0.0.1:{self.store.port}", "epoch": epoch,
                                  "members": members, "sizes": list(plan.bucket_nbytes),
                                  "rounds": rounds, "transport": transport})
        device = next(iter(state.values())).device
        self.transport = make_transport(transport, host="127.0.0.1", timeout_s=120.0,
                                        device=device)
        self.transport.connect(self.store, f"raw{epoch}", 0, len(members) + 1)
        self._done = torch.zeros(1, device=device)

    def round(self) -> float:
        """Seconds until every engine holds every bucket (the allreduce ends the round)."""
        start = time.perf_counter()
        for flat in self.buckets:
            self.transport.send(flat).wait()
        self.transport.group.allreduce([self._done]).wait()
        return time.perf_counter() - start

    def close(self) -> None:
        self.transport.close()


class RawCopy:
    """The baseline of ipc: every bucket copied device to device once per engine, in this
    process (one ``cudaMemcpy`` each): the bytes moved, without handles or processes."""

    def __init__(self, state: dict[str, torch.Tensor], bucket_mb: float, engines: int,
                 alone_mb: float) -> None:
        plan = plan_buckets(state, int(bucket_mb * 2**20), alone_bytes=int(alone_mb * 2**20))
        self.buckets = [pack_bucket(plan, i, state).clone() for i in range(len(plan.bucket_nbytes))]
        self.targets = [[torch.empty_like(flat) for flat in self.buckets] for _ in range(engines)]

    def round(self) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for targets in self.targets:
            for flat, target in zip(self.buckets, targets):
                target.copy_(flat)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        self.targets = []


def bench_config(control: ZmqBufferClient, state: dict[str, torch.Tensor], bucket_mb: float,
                 rounds: int, members: list[str], epoch: int, version: int, alone_mb: float,
                 transport: str) -> tuple[dict[str, list[float]], int]:
    """One warm-up sync, then ``rounds`` x (one sync, one raw round), interleaved so that
    both see the same machine load; returns the samples and the next version."""
    broadcaster = WeightBroadcaster(control, WeightsConfig(
        bucket_mb=bucket_mb, alone_mb=alone_mb, timeout_s=120, transport=transport))
    samples: dict[str, list[float]] = {"sync": [], "raw": [], "pause": [], "send": [],
                                       "ack": []}
    raw = None
    try:
        for i in range(rounds + 1):
            metrics = broadcaster.sync(state, version)
            version += 1
            if metrics["weights/bytes"] == 0:
                raise RuntimeError(f"sync reached no engine: {metrics}")
            if broadcaster.transport != transport:
                raise RuntimeError(f"the sync ran over {broadcaster.transport}, not {transport}")
            if i == 0:
                raw = (RawCopy(state, bucket_mb, len(members), alone_mb) if transport == "ipc"
                       else RawGroup(control, state, bucket_mb, rounds, members, epoch, alone_mb,
                                     transport))
                continue
            samples["sync"].append(metrics["timing/weight_sync"])
            samples["send"].append(metrics["timing/weight_send"])
            samples["ack"].append(metrics["timing/weight_ack"])
            samples["pause"].append(apply_times(control, members))
            samples["raw"].append(raw.round())
    finally:
        broadcaster.close()
        if raw is not None:
            raw.close()
    return samples, version


def apply_times(control: ZmqBufferClient, members: list[str]) -> float:
    """The engines' apply (pause) time for the last update, worst engine."""
    got = [control.get_key(f"bench/apply/{m}", 0, 0.0) for m in members]
    return max(g[1]["apply_s"] for g in got if g is not None)


def run(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    model = build_model(args)
    if transport_kind(args.transport).needs_cuda:
        model = model.to("cuda:0")  # the learner's GPU
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    params = sum(t.numel() for t in state.values())
    logger.info("model: %.1fM parameters, %.1f MB", params / 1e6, nbytes / 1e6)
    address, stop_broker = start_broker_thread(  # raw rounds block heartbeats: a long timeout
        BufferConfig(zmq=ZmqBufferConfig(port=0), heartbeat_timeout_s=600.0), groups_per_step=1)
    control = ZmqBufferClient(address, 120.0)
    procs: list[subprocess.Popen] = []
    rows, version, epoch = [], 1, 1000  # raw groups' store prefixes: epoch1001, ...
    try:
        for count in sorted(args.engines):
            while len(procs) < count:
                procs.append(spawn(address, f"engine-{len(procs)}", argv))
            wait_members(control, count)
            members = [f"engine-{i}" for i in range(count)]
            for bucket_mb in args.bucket_mb:
                epoch += 1
                got, version = bench_config(control, state, bucket_mb, args.rounds, members,
                                            epoch, version, args.alone_mb, args.transport)
                sync, raw = statistics.median(got["sync"]), statistics.median(got["raw"])
                pause_s = statistics.median(got["pause"])
                send_s, ack_s = statistics.median(got["send"]), statistics.median(got["ack"])
                rows.append({"transport": args.transport, "engines": count,
                             "bucket_mb": bucket_mb, "params_m": params / 1e6,
                             "mb": nbytes / 1e6, "sync_s": sync, "raw_s": raw,
                             "sync_gbs": nbytes / sync / 1e9, "raw_gbs": nbytes / raw / 1e9,
                             "ratio": raw / sync, "pause_s": pause_s, "send_s": send_s,
                             "ack_s": ack_s})
                logger.info("%s", rows[-1])
    finally:
        control.set_key(RAW_KEY, {"stop": True})
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        control.close()
        stop_broker()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| transport | engines | bucket MB | params | MB | sync s | sync GB/s | raw s "
            "| raw GB/s | raw/sync | engine pause s | send s | ack wait s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['transport']} | {r['engines']} | {r['bucket_mb']:g} | {r['params_m']:.0f}M "
             f"| {r['mb']:.0f} "
             f"| {r['sync_s']:.3f} | {r['sync_gbs']:.2f} | {r['raw_s']:.3f} "
             f"| {r['raw_gbs']:.2f} | {r['ratio']:.0%} | {r['pause_s']:.3f} "
             f"| {r['send_s']:.3f} | {r['ack_s']:.3f} |" for r in rows]
    return "\n".join([head, *lines])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["gloo", "ipc", "nccl"], default="gloo",
                        help="the weight transport (ipc, nccl: CUDA only)")
    parser.add_argument("--shape", choices=["custom", "qwen2-0.5b"], default="custom",
                        help="qwen2-0.5b: the Qwen2-0.5B shape (bench/qwen_shapes.py FULL, "
                             "~494M parameters), overriding --hidden/--layers/--vocab")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[32, 128, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--commit", choices=["adopt", "copy"], default="adopt",
                        help="engine commit: adopt the received tensors (zero-copy, what "
                             "rollout workers do) or copy them into the model (load_weights)")
    parser.add_argument("--alone-mb", type=float, default=1.0,
                        help="weights.alone_mb: tensors this big are sent from their own "
                             "memory (0: pack every tensor into buckets)")
    parser.add_argument("--malloc-env", action="store_true",
                        help="re-exec with MALLOC_MMAP/TRIM_THRESHOLD_ at 2 GiB (all processes)")
    args = parser.parse_args(argv)
    args.torch_dtype = getattr(torch, args.dtype)
    args.separate_gpus = transport_kind(args.transport).needs_cuda and args.transport != "ipc"
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run ``args`` (None: it can)."""
    if not transport_kind(args.transport).needs_cuda:
        return None
    if not torch.cuda.is_available():
        return (f"--transport {args.transport} needs CUDA, and this machine has none "
                f"(torch {torch.__version__}); --transport gloo runs on CPU")
    needed = 1 + max(args.engines) if args.separate_gpus else 1
    if torch.cuda.device_count() < needed:
        return (f"--transport {args.transport} with {max(args.engines)} engines needs {needed} "
                f"GPUs (one per rank: NCCL refuses two ranks on one GPU); this machine has "
                f"{torch.cuda.device_count()}")
    return None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    if len(sys.argv) > 1 and sys.argv[1] == "receiver":
        address, member, rest = sys.argv[2], sys.argv[3], sys.argv[4:]
        receiver_main(address, member, parse(rest))
        return
    argv = sys.argv[1:]
    args = parse(argv)
    if args.malloc_env and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, __file__, *argv], {**os.environ, **MALLOC_ENV})
    refused = refusal(args)
    if refused is not None:
        print(f"bench/weight_sync.py: {refused}", file=sys.stderr)
        sys.exit(2)
    malloc = "MALLOC_MMAP_THRESHOLD_" in os.environ
    print(f"malloc env: {'tuned' if malloc else 'default'}, commit: {args.commit}, "
          f"alone_mb: {args.alone_mb:g}, transport: {args.transport}")
    rows = run(args, argv)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
