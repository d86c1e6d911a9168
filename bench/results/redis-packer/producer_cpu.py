"""Producer CPU per group of RedisBufferClient.put_many, with redis-py's default packer
(hiredis: copies every argument) or a hybrid that sends large values from their own buffer.

An experiment, not kept (bench/RESULTS.md, "A Redis packer without hiredis's copy"). Run from
the repository root against a PRIVATE redis-server on port 6395 (the script FLUSHALLs it):

    redis-server --port 6395 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes
    .venv/bin/python bench/results/redis-packer/producer_cpu.py default 8192
    .venv/bin/python bench/results/redis-packer/producer_cpu.py hybrid 8192
"""
import sys, time
sys.path.insert(0, '.')
import redis
from redis.connection import PythonRespSerializer, HiredisRespSerializer
from redis._parsers.encoders import Encoder
from bench.buffer_throughput import make_group, Spec
from asyncrl.config.schema import BufferConfig
from buffers.redis_buffer import RedisBufferClient
import buffers.redis_connect as rc

class Hybrid:
    def __init__(self):
        self.py = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        self.hi = HiredisRespSerializer()
    def pack(self, *args):
        for a in args:
            if isinstance(a, (bytes, bytearray, memoryview)) and len(a) > 16384:
                return self.py.pack(*args)
        return self.hi.pack(*args)

from buffers.malloc_tuning import keep_large_buffers; keep_large_buffers()
mode = sys.argv[1]
tokens = int(sys.argv[2])
if mode == "hybrid":
    orig = rc.connection_kwargs
    def ck(config):
        k = orig(config); k["command_packer"] = Hybrid(); return k
    rc.connection_kwargs = ck
cfg = BufferConfig(type="redis", url="redis://127.0.0.1:6395/0", max_groups=100000, namespace=f"bench-{mode}")
c = RedisBufferClient(cfg, "r")
spec = Spec(tokens=tokens, samples=8, batch=8, max_groups=64, redis_url="")
groups = [make_group(spec, "g") for _ in range(8)]
n = 0; cpu = time.process_time(); t = time.perf_counter()
for it in range(40 if tokens == 8192 else 300):
    g = c.acquire("p", 8, 0).granted
    for i, grp in enumerate(groups): grp.group_id = f"x{it}-{i}"
    c.put_many("p", groups)
    n += 8
cpu = time.process_time() - cpu; t = time.perf_counter() - t
print(mode, tokens, f"{cpu/n*1e6:.0f} us CPU/group, {t/n*1e6:.0f} us wall/group")
c._redis.flushall()
