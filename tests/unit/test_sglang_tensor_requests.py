"""The requests an SGLang peer sends over ``ipc`` (``/update_weights_from_tensor``), as SGLang's
``UpdateWeightsFromTensorReqInput`` defines them: built and decoded here, with torch's own
multiprocessing pickler on CPU tensors. No SGLang server has received them (none installs on
these machines); the GPU path hands CUDA IPC handles the same way."""

from __future__ import annotations

import base64
import pickle

import torch

from asyncrl.weights.plan import plan_buckets, unpack_bucket
from rollouters.engines.sglang_engine import tensor_requests


def test_one_request_per_bucket_the_last_flushes_and_sets_the_version() -> None:
    state = {"a": torch.randn(40), "b": torch.randn(3, 5).to(torch.bfloat16),
             "c": torch.arange(30)}
    plan = plan_buckets(state, bucket_bytes=200, align=1)
    named: dict[str, torch.Tensor] = {}
    for index in range(len(plan.bucket_nbytes)):
        names = {spec.name for spec in plan.in_bucket(index)}
        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8)
                          for n, t in state.items() if n in names])
        named.update(unpack_bucket(plan, index, flat))
    requests = tensor_requests(plan, named, version=7, tp_size=2)
    assert len(requests) == len(plan.bucket_nbytes) >= 2
    assert [r["flush_cache"] for r in requests] == [False] * (len(requests) - 1) + [True]
    assert [r["weight_version"] for r in requests] == [None] * (len(requests) - 1) + ["7"]
    seen = []
    for request in requests:
        first, second = request["serialized"]
        assert first == second, "every tensor-parallel rank gets the same list"
        items = pickle.loads(base64.b64decode(first))  # what SGLang's deserialize does
        assert all(isinstance(name, str) and isinstance(t, torch.Tensor) for name, t in items)
        seen += items
    assert [name for name, _ in seen] == list(state)
    assert all(torch.equal(t, state[name]) and t.dtype == state[name].dtype for name, t in seen)
