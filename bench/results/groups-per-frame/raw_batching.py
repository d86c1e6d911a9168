"""The raw half of the several-groups-per-frame experiment (bench/RESULTS.md, 2026-11-25): PUSH ->
zmq.proxy -> PULL of 106,900-byte messages (one 8x1k group) against 8 of them per message,
two runs each, 2 s per run. Kept as run, for the record; not part of the benchmark suite."""
import sys, time, zmq, multiprocessing as mp
def proxy(io):
    c = zmq.Context(io); a = c.socket(zmq.PULL); b = c.socket(zmq.PUSH)
    for s in (a, b): s.setsockopt(zmq.SNDHWM, 64); s.setsockopt(zmq.RCVHWM, 64)
    a.bind("tcp://127.0.0.1:5701"); b.bind("tcp://127.0.0.1:5702"); zmq.proxy(a, b)
def prod(size, per, stop):
    c = zmq.Context(); s = c.socket(zmq.PUSH); s.setsockopt(zmq.SNDHWM, 64); s.connect("tcp://127.0.0.1:5701")
    msg = b"x" * (size * per)
    frames = [msg] if per else None
    while not stop.is_set():
        s.send(msg, copy=False)
if __name__ == "__main__":
    size = 106_900
    for per in (1, 8, 1, 8):
        ctx = mp.get_context("spawn"); stop = ctx.Event()
        px = ctx.Process(target=proxy, args=(2,), daemon=True); px.start()
        c = zmq.Context(); pull = c.socket(zmq.PULL); pull.setsockopt(zmq.RCVHWM, 64); pull.connect("tcp://127.0.0.1:5702")
        pr = ctx.Process(target=prod, args=(size, per, stop), daemon=True); pr.start()
        pull.recv(copy=False); t = time.perf_counter(); n = 0
        while time.perf_counter() - t < 2: pull.recv(copy=False); n += per
        dt = time.perf_counter() - t
        print(per, "groups/s %.0f" % (n / dt), "MB/s %.0f" % (n * size / dt / 1e6))
        stop.set(); px.terminate(); pr.terminate(); pr.join(); px.join(); pull.close(); c.term()
