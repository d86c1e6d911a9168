"""A stand-in for an SGLang server, because SGLang cannot be installed on these CPU machines
(it pins a CUDA torch build). It is NOT SGLang: it is a protocol fixture that behaves as
SGLang 0.5.x does at its HTTP and process-group boundaries.

* Every request body is validated against the documented SGLang request schemas
  (``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput`` and its sampling params,
  ``InitWeightsUpdateGroupReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
  ``UpdateWeightsFromDistributedReqInput``, ``PauseGenerationReqInput``,
  ``ContinueGenerationReqInput``, ``UpdateWeightVersionReqInput``,
  ``ReleaseMemoryOccupationReqInput``, ``ResumeMemoryOccupationReqInput``): required fields,
  field types, and no unknown fields; a violation is answered with HTTP 400. Answers have the
  documented response shapes, and every call is recorded.
* ``/init_weights_update_group`` joins the learner's group the way SGLang's
  ``init_custom_process_group`` does: torch's ``tcp://`` rendezvous at
  ``master_address:master_port`` as rank ``rank_offset`` (tp_rank 0), ``PrefixStore(group_name)``,
  then torch's own ``_new_process_group_helper`` (which adds its ``group_name/`` and device
  prefixes) and the ``pg_group_ranks`` registration. So our learner's side of the group is
  tested against torch's real key layout, not against a copy of our own.
* ``/update_weights_from_distributed`` with ``load_format = "flattened_bucket"`` receives ONE
  ``uint8`` ``torch.distributed.broadcast`` from rank 0, splits it back to back into the named
  tensors (``FlattenedTensorBucket``) and loads them; without it, one broadcast per tensor. A
  tensor misaligned for its dtype in the bucket is refused before the receive, as SGLang
  0.5.23 does.
* Weight updates load only inside a session, ``/begin_weight_update`` ...
  ``/end_weight_update`` (SGLang 0.5.23's scheduler: an update outside one, a second begin,
  an end without a begin are refused); ``sessions=False`` is an SGLang from before them (404).
* An update that asks to flush the cache (``flush_cache``, true by default) is refused after
  loading while a request runs, unless generation was paused with ``retract`` (SGLang's
  ``flush_cache`` needs an idle scheduler; ``in_place`` leaves the requests running).
* ``/generate`` with ``input_ids`` serves a real tiny torch model (``--model-path``) through
  :class:`TorchEngine`, returning ``output_ids`` and ``meta_info.output_token_logprobs`` as
  ``[logprob, token_id, null]`` triples, and ``meta_info.weight_versions`` (SGLang 0.5.23's
  spans; ``spans=False`` leaves them out): an update while a request ran splits its tokens
  in two halves; without a model (unit tests) it answers scripted tokens.
  ``/pause_generation`` holds new generation until ``/continue_generation``.
* ``/release_memory_occupation`` and ``/resume_memory_occupation`` (``--enable-memory-saver``)
  keep the set of released tags as SGLang's scheduler does (``offload_tags``; no tags: all,
  here ``weights`` and ``kv_cache``), and refuse what it refuses: a release while a request
  runs (it must be idle), a resume of a tag not released (SGLang's ``offload_tags.remove``
  fails). What SGLang cannot do with memory released is refused too, where it would fail or
  read freed memory: ``/generate`` while anything is released, a weight update while the
  weights are. Nothing is freed: the fixture only checks the order of the calls.

Run it as ``python -m tests.engines.sglang_fixture`` with ``sglang.launch_server``'s flags (the
subset :func:`rollouters.engines.sglang_engine.server_args` passes; anything else is refused),
or in-process through :func:`serve`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

INT, STR, BOOL, NUM = (int,), (str,), (bool,), (int, float)
OPT_STR = (str, type(None))
MEMORY_TYPES = ("weights", "kv_cache")  # SGLang's GPU memory tags that this fixture knows
SELECTORS = ("target", "draft", "all")  # which runners (the model, a speculative draft)
GROUP_TIMEOUT_S = 60.0


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# path → (required fields, optional fields); a type tuple, or a callable check
SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "/generate": ({}, {
        "input_ids": lambda v: isinstance(v, list) and all(
            isinstance(row, list) and row and all(type(t) is int for t in row) for row in v),
        "sampling_params": dict, "return_logprob": BOOL, "rid": STR, "stream": BOOL,
        "return_text_in_logprobs": BOOL, "logprob_start_len": INT, "top_logprobs_num": INT}),
    "/init_weights_update_group": (
        {"master_address": STR, "master_port": INT, "rank_offset": INT, "world_size": INT},
        {"group_name": STR, "backend": STR}),
    "/destroy_weights_update_group": ({}, {"group_name": STR}),
    "/update_weights_from_distributed": (
        {"names": _str_list, "dtypes": _str_list,
         "shapes": lambda v: isinstance(v, list) and all(
             isinstance(s, list) and all(type(d) is int for d in s) for s in v)},
        {"group_name": STR, "flush_cache": BOOL, "abort_all_requests": BOOL,
         "weight_version": OPT_STR, "load_format": OPT_STR, "torch_empty_cache": BOOL,
         "selector": lambda v: v in SELECTORS}),
    "/update_weights_from_tensor": (
        {"serialized_named_tensors": _str_list},
        {"load_format": OPT_STR, "flush_cache": BOOL, "abort_all_requests": BOOL,
         "weight_version": OPT_STR, "torch_empty_cache": BOOL,
         "selector": lambda v: v in SELECTORS}),
    "/begin_weight_update": ({}, {"selector": lambda v: v in SELECTORS}),
    "/end_weight_update": ({}, {}),
    "/pause_generation": ({}, {"mode": lambda v: v in ("abort", "retract", "in_place")}),
    "/continue_generation": ({}, {"torch_empty_cache": BOOL}),
    "/update_weight_version": ({"new_version": STR}, {"abort_all_requests": BOOL}),
    "/release_memory_occupation": ({}, {"tags": lambda v: v is None or _str_list(v),
                                        "rid": OPT_STR}),
    "/resume_memory_occupation": ({}, {"tags": lambda v: v is None or _str_list(v),
                                       "rid": OPT_STR}),
}
SAMPLING = {"temperature": NUM, "max_new_tokens": INT, "n": INT, "top_p": NUM, "top_k": INT,
            "stop_token_ids": list, "ignore_eos": BOOL}
GET_PATHS = ("/health", "/health_generate")


def _check(fields: dict[str, Any], spec: Any, name: str) -> str | None:
    value = fields[name]
    if callable(spec) and not isinstance(spec, (tuple, type)):
        return None if spec(value) else f"bad value for {name}: {value!r}"
    types = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(value, bool) and bool not in types:
        return f"{name} must be {types}, got bool"
    return None if isinstance(value, types) else f"{name} must be {types}, got {value!r}"


def validate(path: str, body: Any) -> str | None:
    """The first schema violation in ``body`` for ``path``, or None."""
    if path not in SCHEMAS:
        return f"unknown path {path}"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    required, optional = SCHEMAS[path]
    for name in required:
        if name not in body:
            return f"missing required field {name}"
    for name in body:
        spec = required.get(name, optional.get(name))
        if spec is None:
            return f"unknown field {name}"
        error = _check(body, spec, name)
        if error:
            return error
    for name in body.get("sampling_params", {}) if path == "/generate" else ():
        if name not in SAMPLING:
            return f"unknown sampling param {name}"
        error = _check(body["sampling_params"], SAMPLING[name], name)
        if error:
            return error
    return None


def join_like_sglang(master_address: str, master_port: int, rank: int, world_size: int,
                     group_name: str, backend: str) -> dist.ProcessGroup:
    """What SGLang's ``init_weights_update_group`` → ``init_custom_process_group`` does for
    tp_rank 0, written from its documented behaviour: rendezvous through torch, a
    ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``, and the rank map
    ``torch.distributed.broadcast(group=...)`` needs."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                              world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store), group_name=group_name,
                                      timeout=timeout, group_desc=group_name)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class FakeSglang:
    """State and answers of the fixture server. ``model_dir`` None: scripted generation;
    ``join_groups`` False: weight calls are validated and recorded but join nothing (unit
    tests of the client alone). ``hold`` makes ``/generate`` wait for ``release`` (and sets
    ``arrived``), so tests can interleave calls deterministically."""

    def __init__(self, model_dir: str | None = None, join_groups: bool = False,
                 dtype: str = "float32", seed: int = 0, sessions: bool = True,
                 spans: bool = True) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.sessions = sessions  # False: an SGLang without weight-update sessions
        self.spans = spans  # False: an SGLang whose outputs carry no weight_versions
        self.session_open = False
        self.pause_mode: str | None = None  # while paused: PauseGenerationReqInput.mode
        self.weight_version = "default"
        self.hold = False
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.join_groups = join_groups
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.received: dict[str, torch.Tensor] = {}
        self._running = threading.Condition()  # guards _paused and _generating
        self._paused = False
        self._generating = 0  # /generate calls being answered
        self.released: set[str] = set()  # SGLang's offload_tags
        self.engine = None
        if model_dir is not None:
            from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
            from rollouters.engines.torch_engine import TorchEngine

            self.eos_id = EOS_ID
            self.engine = TorchEngine(load_causal_lm(model_dir, dtype, "cpu"), eos_ids=(EOS_ID,),
                                      pad_id=PAD_ID, seed=seed)

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append((path, body))
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self._memory(path, body.get("tags") or list(MEMORY_TYPES))
        refused = self._refused_while_released(path)
        if refused:
            return 400, {"error": {"message": refused}}
        if path == "/generate":
            with self._running:
                self._generating += 1
            try:
                return 200, self._generate(body)
            finally:
                with self._running:
                    self._generating -= 1
        if path in ("/begin_weight_update", "/end_weight_update"):
            return self._session(path)
        if path.startswith("/update_weights") and self.sessions and not self.session_open:
            return 400, {"success": False, "message": f"{path.lstrip('/')} must run between "
                         "begin_weight_update() and end_weight_update()"}
        if path == "/pause_generation":
            with self._running:
                self._paused = True
                self.pause_mode = body.get("mode", "abort")
            return 200, {"message": "Generation paused successfully."}
        if path == "/continue_generation":
            with self._running:
                self._paused = False
                self.pause_mode = None
                self._running.notify_all()
            return 200, {"message": "Generation continued successfully."}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "message": "ok", "new_version": self.weight_version}
        if path == "/init_weights_update_group" and self.join_groups:
            return self._join(body)
        if path == "/destroy_weights_update_group" and self.join_groups:
            return self._destroy(body.get("group_name", "weight_update_group"))
        if path == "/update_weights_from_distributed" and self.join_groups:
            status, answer = self._receive(body)
            return (status, answer) if status != 200 else self._flushed(body, answer)
        if path.startswith("/update_weights") and body.get("weight_version"):
            self.weight_version = body["weight_version"]
        return self._flushed(body, {"success": True,
                                    "message": "Succeeded to update parameter online."})

    def _session(self, path: str) -> tuple[int, Any]:
        """SGLang's weight-update session: begin opens it (one at a time), end closes it."""
        if not self.sessions:
            return 404, {"detail": "Not Found"}
        if path == "/begin_weight_update":
            if self.session_open:
                return 400, {"success": False, "message": "a weight-update session is already "
                             "open; call end_weight_update() first"}
            self.session_open = True
        else:
            if not self.session_open:
                return 400, {"success": False, "message": "no weight-update session is open; "
                             "call begin_weight_update() first"}
            self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def _flushed(self, body: dict[str, Any], answer: dict[str, Any]) -> tuple[int, Any]:
        """After a load: SGLang's cache flush, refused unless no request runs (a ``retract``
        pause moved them back to the queue, which a paused flush ignores)."""
        with self._running:
            busy = self._generating and not (self._paused and self.pause_mode == "retract")
        if body.get("flush_cache", True) and busy:
            return 400, {"success": False, "message": "Weights were updated, but the cache was "
                         "not flushed because requests are still running or queued. Retract "
                         "or finish them, then call /flush_cache."}
        return 200, answer

    def _memory(self, path: str, tags: list[str]) -> tuple[int, Any]:
        """SGLang's scheduler: a release (idle only) adds the tags to ``offload_tags``, a
        resume removes them (a tag not released fails there). Answers ``null``, as its
        route does."""
        unknown = [tag for tag in tags if tag not in MEMORY_TYPES]
        if unknown:
            return 400, {"error": {"message": f"unknown memory tags {unknown}"}}
        with self._running:
            if path == "/release_memory_occupation":
                if self._generating:
                    return 400, {"error": {"message": "release_memory_occupation should be "
                                                      "called only when server is idle."}}
                self.released.update(tags)
                return 200, None
            missing = [tag for tag in tags if tag not in self.released]
            if missing:
                return 400, {"error": {"message": f"KeyError: {missing[0]!r}"}}
            self.released.difference_update(tags)
        return 200, None

    def _refused_while_released(self, path: str) -> str | None:
        """What SGLang cannot serve with memory released: no generation while anything is
        (no KV cache, or freed weights), no weight update while the weights are."""
        released = sorted(self.released)
        if path == "/generate" and released:
            return f"/generate with memory released: {released}"
        if path.startswith("/update_weights") and "weights" in released:
            return f"{path} with the weights released"
        return None

    def _join(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return 400, {"success": False, "message": f"group {name!r} already exists"}
        try:
            self.groups[name] = join_like_sglang(
                body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], name, body.get("backend", "nccl"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed join, never dies
            return 400, {"success": False,
                         "message": f"Failed to initialize custom process group: {exc}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _destroy(self, name: str) -> tuple[int, Any]:
        group = self.groups.pop(name, None)
        if group is None:
            return 400, {"success": False,
                         "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(group)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def _receive(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return 400, {"success": False, "message": f"Group {name} not in {list(self.groups)}"}
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        sizes = [math.prod(s) * torch.empty(0, dtype=d).element_size()
                 for s, d in zip(body["shapes"], dtypes)]
        if body.get("load_format") == "flattened_bucket":
            offset = 0
            for tensor, dtype, size in zip(body["names"], dtypes, sizes):
                if offset % dtype.itemsize:   # refused before the receive, as SGLang does
                    return 400, {"success": False, "message": "Failed to receive weights: "
                                 f"Unaligned received tensor {tensor}: byte offset {offset}, "
                                 f"dtype {dtype}"}
                offset += size
        try:
            if body.get("load_format") == "flattened_bucket":
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=self.groups[name])
                parts = [part.view(d).view(s)
                         for part, d, s in zip(flat.split(sizes), dtypes, body["shapes"])]
            else:
                parts = [torch.empty(s, dtype=d) for s, d in zip(body["shapes"], dtypes)]
                for part in parts:
                    dist.broadcast(part, src=0, group=self.groups[name])
        except RuntimeError as exc:
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}"}
        named = dict(zip(body["names"], parts))
        self.received.update(named)
        if body.get("weight_version"):
            self.weight_version = body["weight_version"]
        if self.engine is not None:
            version = int(self.weight_version) if self.weight_version.isdigit() else 0
            self.engine.load_weights(named.items(), version)
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def _generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        before = self.weight_version   # the version the request started with
        if self.hold:
            self.arrived.set()
            self.release.wait(timeout=30)
        with self._running:
            self._running.wait_for(lambda: not self._paused, timeout=GROUP_TIMEOUT_S)
        params = body.get("sampling_params", {})
        rows = body["input_ids"]
        if self.engine is None:
            return self._scripted(rows, params["max_new_tokens"], before)
        temperature = float(params.get("temperature", 1.0))
        outs = self.engine.generate(rows, 1, temperature or 1.0, params["max_new_tokens"],
                                    greedy=temperature == 0.0)
        answers = []
        for i, (row, (completion,)) in enumerate(zip(rows, outs)):
            stop = completion.finish_reason == "stop"
            reason = ({"type": "stop", "matched": self.eos_id} if stop
                      else {"type": "length", "length": len(completion.tokens)})
            answers.append(self._item(i, row, completion.tokens, completion.logprobs, reason,
                                      before))
        return answers

    def _scripted(self, rows: list[list[int]], n_new: int, before: str
                  ) -> list[dict[str, Any]]:
        out = []
        for i, row in enumerate(rows):
            tokens = [(sum(row) + i + k) % 50 for k in range(n_new)]
            out.append(self._item(i, row, tokens, [-0.1 * (k + 1) for k in range(n_new)],
                                  {"type": "length", "length": n_new}, before))
        return out

    def _item(self, i: int, row: list[int], tokens: list[int], logprobs: list[float],
              reason: dict[str, Any], before: str) -> dict[str, Any]:
        meta = {"id": f"req-{i}", "finish_reason": reason, "prompt_tokens": len(row),
                "completion_tokens": len(tokens), "weight_version": self.weight_version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)]}
        if self.spans:
            meta["weight_versions"] = self._spans(len(tokens), before)
        return {"output_ids": tokens, "meta_info": meta}

    def _spans(self, count: int, before: str) -> list[dict[str, Any]]:
        """SGLang's ``weight_versions``: one span, or two when an update landed while the
        request ran (here, scripted: the first half of the tokens before it)."""
        after = self.weight_version
        if before == after:
            return [{"version": after, "start": 0, "end": count}]
        return [{"version": before, "start": 0, "end": count // 2},
                {"version": after, "start": count // 2, "end": count}]

    def close(self) -> None:
        for name in list(self.groups):
            self._destroy(name)


def _handler(fake: FakeSglang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path in GET_PATHS:
                return self._send(200, None)
            self._send(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                return self._send(400, {"error": "invalid JSON"})
            error = validate(self.path, body)
            if error:
                return self._send(400, {"error": error})
            self._send(*fake.answer(self.path, body))

        def _send(self, status: int, payload: Any) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # keep test output clean
            return None

    return Handler


@contextmanager
def serve(fake: FakeSglang, host: str = "127.0.0.1",
          port: int = 0) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    """Serve ``fake`` on a thread; yields its base URL and the server."""
    httpd = ThreadingHTTPServer((host, port), _handler(fake))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{httpd.server_address[1]}", httpd
    finally:
        fake.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        fake.close()


def main(argv: list[str] | None = None) -> None:
    """``sglang.launch_server``'s flags, the subset our launcher passes; unknown ones fail."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--enable-memory-saver", action="store_true")  # colocate: sleeps
    args = parser.parse_args(argv)
    if not args.skip_tokenizer_init:
        parser.error("this fixture serves token ids only: pass --skip-tokenizer-init")
    if args.tp_size != 1:
        parser.error("this fixture has one tensor-parallel rank")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    fake = FakeSglang(args.model_path, join_groups=True, dtype=dtype, seed=args.random_seed)
    with serve(fake, args.host, args.port) as (url, httpd):
        logger.info("SGLang protocol fixture serving %s at %s", args.model_path, url)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
