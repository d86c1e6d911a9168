"""A pure-torch inference engine: batched KV-cached sampling on any HF causal LM.

Slow next to vLLM, but exact, dependency-free and CPU-friendly: the reference engine for tests
and for the tiny-model runs. The lock is held per decode step, not per call, so a weight update
lands between two steps of an in-flight batch; ``Completion.versions`` records, per token, the
version whose forward pass produced it.

For ``launcher.colocate`` the engine can sleep (:meth:`TorchEngine.sleep`): it lets the calls
in flight finish, moves its weights to host memory and makes new calls wait until
:meth:`TorchEngine.wake_up`, so the learner can have the device meanwhile.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.devices import release_device_memory
from asyncrl.weights.fit import check_fit
from asyncrl.weights.lora_wire import split_adapters
from rollouters.engines.base import Completion, check_generate_args
from rollouters.engines.lora_merge import LoraMerger
from rollouters.engines.routing import RoutingRecorder, maybe_record

logger = logging.getLogger(__name__)


@dataclass
class _Batch:
    """Decode state for one :meth:`TorchEngine.generate` call."""

    attention_mask: torch.Tensor  # (B, T) grows by one column per step
    next_position: torch.Tensor  # (B,) position id of the next input token
    finished: torch.Tensor  # (B,) bool
    tokens: list[torch.Tensor]  # one (B,) tensor per step
    logprobs: list[torch.Tensor]
    versions: list[int]
    routing: list[torch.Tensor] = field(default_factory=list)  # per forward, when recorded
    vision: dict[str, Any] = field(default_factory=dict)  # the prefill's image inputs
    rope_deltas: torch.Tensor | None = None  # (B, 1) VLM: M-RoPE position - sequence index


class TorchEngine:
    """Implements :class:`~rollouters.engines.base.Engine` over an ``nn.Module`` causal LM.

    ``on_step(step)`` (optional) is called after each decode step, outside the lock: a test hook
    to interleave weight loads deterministically. ``record_routing``: each completion carries
    the experts its tokens were routed to (an MoE model; :mod:`rollouters.engines.routing`).
    ``image_processor``: a vision-language model's (:mod:`asyncrl.vlm`); prompts may then come
    with images.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: Sequence[int], pad_id: int,
                 version: int = 0,
                 device: str | torch.device = "cpu", seed: int | None = None,
                 on_step: Callable[[int], None] | None = None,
                 record_routing: bool = False, image_processor: Any = None) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.image_processor = image_processor
        self._routing = RoutingRecorder(self.model) if record_routing else None
        self.eos_ids = tuple(eos_ids)  # any of them ends a row (asyncrl.tokens)
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self.pad_id = pad_id
        self.on_step = on_step
        self._version = version
        self._lock = threading.Lock()
        # Sleep (launcher.colocate): generate calls in flight, and the offloaded weights:
        # id(parameter) → (parameter, its host copy). Empty while awake.
        self._phase = threading.Condition()
        self._active = 0
        self._asleep = False
        self._offloaded: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._caches: weakref.WeakSet = weakref.WeakSet()  # the KV caches of calls in flight
        self._lora = LoraMerger()  # base copies of the weights LoRA updates merge into
        self._generator = torch.Generator(self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False,
                 images: list[list[bytes]] | None = None) -> list[list[Completion]]:
        """``n`` completions per prompt; greedy takes the argmax and records logprobs at T=1.
        ``images``: each prompt's encoded images, its ids already expanded
        (:mod:`asyncrl.vlm`)."""
        check_generate_args(prompts, n, temperature, max_new_tokens, greedy, images)
        if images is not None and any(images) and self.image_processor is None:
            raise ValueError("images were given to a torch engine without an image processor "
                             "(a text-only model?)")
        with self._phase:  # asleep: wait for the wake (launcher.colocate)
            self._phase.wait_for(lambda: not self._asleep)
            self._active += 1
        try:
            return self._generate(prompts, n, temperature, max_new_tokens, greedy, images)
        finally:
            with self._phase:
                self._active -= 1
                self._phase.notify_all()

    def _generate(self, prompts: list[list[int]], n: int, temperature: float,
                  max_new_tokens: int, greedy: bool,
                  images: list[list[bytes]] | None) -> list[list[Completion]]:
        temperature = 1.0 if greedy else temperature
        rows = [p for p in prompts for _ in range(n)]
        input_ids, batch = self._left_pad(rows)
        if images is not None and any(images):
            self._add_vision(input_ids, batch, images, n)
        past = None
        for step in range(max_new_tokens):
            past = self._step(input_ids, batch, past, temperature, greedy)
            if self.on_step is not None:
                self.on_step(step)
            if bool(batch.finished.all()):
                break
            input_ids = torch.where(batch.finished, self.pad_id, batch.tokens[-1])[:, None]
        completions = self._completions(batch)
        if self._routing is not None:
            self._routing.attach(completions, batch.routing, [len(r) for r in rows])
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, _Batch]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        batch = _Batch(attention_mask=mask, next_position=mask.sum(-1),
                       finished=torch.zeros(len(rows), dtype=torch.bool, device=self.device),
                       tokens=[], logprobs=[], versions=[])
        return ids, batch

    def _add_vision(self, input_ids: torch.Tensor, batch: _Batch, images: list[list[bytes]],
                    n: int) -> None:
        """The prefill's image inputs and the rows' M-RoPE positions
        (:func:`asyncrl.vlm.rope_positions`). A prompt's ``n`` rows are identical until they
        sample: its images are decoded, encoded by the vision tower (:meth:`_step`) and its
        positions computed once, not ``n`` times."""
        from asyncrl.vlm import rope_positions, vision_inputs

        pixels, grids, counts = [], [], []
        for prompt_images in images:
            if prompt_images:
                pixel_values, grid = vision_inputs(self.image_processor, prompt_images)
                pixels.append(pixel_values)
                grids.append(grid)
                counts.append(len(prompt_images))
        grid = torch.cat(grids)   # each prompt's images once
        batch.vision = {"pixel_values": torch.cat(pixels).to(self.device),
                        "image_grid_thw": grid.to(self.device),
                        "images_per_prompt": torch.tensor(counts), "rows_per_prompt": n}
        positions, deltas = rope_positions(self.model, input_ids[::n], batch.attention_mask[::n],
                                           grid)
        batch.rope_deltas = deltas.repeat_interleave(n, 0)
        batch.vision["position_ids"] = positions.repeat_interleave(n, 1)

    def _encoded_images(self, vision: dict) -> dict:
        """The prefill's image features: each prompt's images through the vision tower once,
        given to each of its rows (``mm_encoder_outputs``). Under the lock: the weights of the
        features and of the prefill are one version."""
        from asyncrl.vlm import vl_model

        features = vl_model(self.model).get_image_features(
            vision["pixel_values"], vision["image_grid_thw"], return_dict=True)
        per_image = list(features.pooler_output)
        rows, start = [], 0
        for count in vision["images_per_prompt"].tolist():
            rows += per_image[start:start + count] * vision["rows_per_prompt"]
            start += count
        features.pooler_output = tuple(rows)
        return {"mm_encoder_outputs": {"image": features}}

    def _positions(self, batch: _Batch, prefill: bool) -> torch.Tensor:
        """Position ids of the next forward's inputs: 3-D (M-RoPE) for a VLM's batch."""
        if prefill:
            return batch.vision.pop("position_ids", None) if batch.rope_deltas is not None \
                else (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        positions = batch.next_position[:, None]
        if batch.rope_deltas is not None:
            positions = (positions + batch.rope_deltas)[None].expand(3, -1, -1)
        return positions

    def _step(self, input_ids: torch.Tensor, batch: _Batch, past: object,
              temperature: float, greedy: bool) -> object:
        """One forward (the prefill when ``past`` is None) and one sampled token per row."""
        positions = self._positions(batch, prefill=past is None)
        if past is not None:
            ones = torch.ones_like(batch.attention_mask[:, :1])
            batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=-1)
            batch.next_position = batch.next_position + 1
        with (self._lock, torch.inference_mode(),
              maybe_record(self._routing, batch.routing, input_ids.shape)):
            vision = self._encoded_images(batch.vision) if past is None and batch.vision \
                else {}
            out = self.model(input_ids=input_ids, attention_mask=batch.attention_mask,
                             position_ids=positions, past_key_values=past, use_cache=True,
                             logits_to_keep=1, **vision)
            version = self._version
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
            if greedy:
                token = logp.argmax(-1)
            else:
                token = torch.multinomial(logp.exp(), 1, generator=self._generator)[:, 0]
        token = torch.where(batch.finished, self.pad_id, token)
        batch.tokens.append(token)
        batch.logprobs.append(logp.gather(-1, token[:, None])[:, 0])
        batch.versions.append(version)
        batch.finished = batch.finished | torch.isin(token, self._eos)
        self._caches.add(out.past_key_values)
        return out.past_key_values

    def _completions(self, batch: _Batch) -> list[Completion]:
        tokens = torch.stack(batch.tokens, dim=1).tolist()
        logprobs = torch.stack(batch.logprobs, dim=1).tolist()
        result = []
        for row_tokens, row_logprobs in zip(tokens, logprobs):
            length = next((i + 1 for i, t in enumerate(row_tokens) if t in self.eos_ids),
                          None)
            reason = "length" if length is None else "stop"
            length = length or len(row_tokens)
            result.append(Completion(tokens=row_tokens[:length], logprobs=row_logprobs[:length],
                                     versions=batch.versions[:length], finish_reason=reason))
        return result

    @property
    def weights_device(self) -> torch.device:
        """Where weight updates should land: the model's device. Over ``nccl`` the buckets
        arrive there, over ``ipc`` they are copied there from the learner's memory on the same
        GPU, so :meth:`adopt_weights` can keep them without another copy."""
        return self.device

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy named tensors into the model in place, then set :attr:`version`.

        Names are checked before anything is copied, so a bad update leaves the model as it
        was. Tied weights (``lm_head.weight`` and ``model.embed_tokens.weight``) resolve to the
        same storage; either name, or both, may be sent. LoRA adapters
        (``asyncrl.weights.lora_wire`` names) are merged into the base weights
        (``rollouters.engines.lora_merge``).
        """
        adapters, items = split_adapters(weights)
        with self._lock, torch.no_grad():
            targets = self._named_tensors()
            self._check(items, targets)
            merged = self._lora.merged(adapters, targets, replaced=[n for n, _ in items])
            for name, tensor in items:
                targets[name].copy_(tensor)
            self._assign(merged)
            self._version = version
        logger.debug("loaded %d tensors and %d adapters, version %d", len(items), len(adapters),
                     version)

    def adopt_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make the given tensors the model's parameters (no copy), then set :attr:`version`.

        The zero-copy commit of a weight update: the receiver lands every bucket in buffers
        the model does not use, and the commit only re-points each parameter at its new
        tensor, so the engine's pause is microseconds per tensor instead of one memcpy of the
        model. The caller hands ownership over: it must not write into these tensors while
        the model holds them (:class:`~asyncrl.weights.receiver.WeightReceiver` with
        ``adopt=True`` alternates two receive pools for this). A tensor that cannot be a
        parameter as it is (other dtype or device, not contiguous) and buffers are copied.
        All names and shapes are checked first, so a bad update changes nothing. LoRA
        adapters are merged, as by :meth:`load_weights` (the merge makes new tensors: nothing
        of the receiver's buffers is kept). Asleep (:meth:`sleep`) nothing is adopted: the
        tensors are copied into the host copies, and the device stays free until the wake.
        """
        adapters, items = split_adapters(weights.items())
        with self._lock, torch.no_grad():
            targets = self._named_tensors()
            self._check(items, targets)
            merged = self._lora.merged(adapters, targets, replaced=[n for n, _ in items])
            params = dict(self.model.named_parameters(remove_duplicate=False))
            adopted = 0
            for name, tensor in items:
                target = targets[name]
                if (name in params and not self._offloaded and tensor.dtype == target.dtype
                        and tensor.device == target.device and tensor.is_contiguous()):
                    params[name].data = tensor
                    adopted += 1
                else:
                    target.copy_(tensor)
            self._assign(merged)
            self._version = version
        logger.debug("adopted %d of %d tensors, version %d", adopted, len(weights), version)

    def _assign(self, merged: dict[str, torch.Tensor]) -> None:
        """Make each merged LoRA weight its parameter's data (a new tensor, so a parameter
        that viewed an adopted receive buffer stops viewing it). Under the lock."""
        if not merged:
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in merged.items():
            offloaded = self._offloaded.get(id(params[name]))
            if offloaded is None:
                params[name].data = tensor
            else:  # asleep: the host copy is what the wake brings back
                self._offloaded[id(params[name])] = (params[name], _to_host(tensor))

    @staticmethod
    def _check(items: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor]) -> None:
        check_fit(items, {name: target.shape for name, target in targets.items()})

    def close(self) -> None:
        """Nothing to release: the model lives and dies with this object."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of every parameter and buffer, tied names included."""
        with self._lock, torch.no_grad():
            return {name: t.detach().clone() for name, t in self._named_tensors().items()}

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by name; asleep, a parameter's host copy stands for it
        (a weight update then lands there, and the wake brings it to the device)."""
        named = {name: self._offloaded.get(id(p), (p, p))[1]
                 for name, p in self.model.named_parameters(remove_duplicate=False)}
        named.update(self.model.named_buffers(remove_duplicate=False))
        return named

    # --- sleep and wake (launcher.colocate) ------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Wait for the generate calls in flight to end (their KV caches die with them), then
        move every parameter to a host copy and release its device storage; later generate
        calls wait for :meth:`wake_up`. Buffers (rotary tables) stay: they are small. On CUDA
        the allocator's cached blocks and cuBLAS's workspaces go back to the device, for the
        learner to use."""
        with self._phase:
            self._asleep = True
            self._phase.wait_for(lambda: self._active == 0)
        with self._lock, torch.no_grad():
            for param in self.model.parameters():  # tied weights: one parameter, moved once
                if id(param) not in self._offloaded:
                    self._offloaded[id(param)] = (param, _to_host(param.data))
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        release_device_memory(self.device)   # no generate call is left to use a workspace
        logger.debug("asleep: %.1f MB of weights in host memory", self.memory()["host_bytes"] / 1e6)

    def wake_up(self) -> None:
        """Bring every parameter back to the device from its host copy (which is let go),
        then let generation go on."""
        with self._lock, torch.no_grad():
            for param, host in self._offloaded.values():
                param.data = host.to(self.device, copy=True)
            self._offloaded = {}
            if self.device.type == "cuda":   # memory()'s peak: of this rollout phase
                torch.cuda.reset_peak_memory_stats(self.device)
        with self._phase:
            self._asleep = False
            self._phase.notify_all()

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds: its parameters on the device (``weights_bytes``), their
        host copies while asleep (``host_bytes``), the KV caches of calls in flight
        (``kv_bytes``); on CUDA also everything the process has allocated on the device
        (``device_allocated_bytes``) and the most it has held since the last wake
        (``device_peak_bytes``: the rollout phase's peak, when asked asleep)."""
        with self._lock:
            weights = sum(p.untyped_storage().nbytes() for p in self.model.parameters())
            host = sum(h.untyped_storage().nbytes() for _, h in self._offloaded.values())
        kv = sum(t.untyped_storage().nbytes() for cache in list(self._caches)
                 for t in _cache_tensors(cache))
        held = {"weights_bytes": weights, "host_bytes": host, "kv_bytes": kv}
        if self.device.type == "cuda":   # all this process holds there (receive pools too)
            held["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            held["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return held


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, in storage of its own (pinned for a CUDA tensor:
    the wake's copy back is then a DMA); on CPU too a new allocation, so the moves are real."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                       pin_memory=tensor.is_cuda)
    return host.copy_(tensor)


def _cache_tensors(cache: object) -> list[torch.Tensor]:
    """The key and value tensors of an HF KV cache (``DynamicCache``: one entry per layer)."""
    found = []
    for layer in getattr(cache, "layers", ()):
        found += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                  if isinstance(t, torch.Tensor)]
    return found
