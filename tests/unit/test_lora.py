"""LoRA pieces that need no process group: the config, the adapter wire format, the learner's
merge (checked against peft's own ``merge_and_unload``) and the torch engine's merge."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from asyncrl.config import ConfigError, load_config  # noqa: E402
from asyncrl.config.schema import LoraConfig, TinyModelConfig  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, VOCAB, build_tiny_model  # noqa: E402
from asyncrl.weights.fit import WeightsRefused  # noqa: E402
from asyncrl.weights.lora_wire import adapter_name, merge, split_adapters  # noqa: E402
from learners.lora import merged_state, sends_adapters, wrap_lora  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402

torch.set_num_threads(1)

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
Q = "model.layers.0.self_attn.q_proj.weight"
PROMPT = torch.tensor([[1, 5, 6, 7, 8, 2]])


# --- config ---------------------------------------------------------------------------------

def test_lora_is_off_by_default_and_set_turns_it_on() -> None:
    assert load_config(None).model.lora.rank == 0
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.alpha=32",
                             "model.lora.target_modules=[\"q_proj\", \"v_proj\"]"])
    assert (cfg.model.lora.rank, cfg.model.lora.scale) == (8, 4.0)
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert sends_adapters(cfg)   # the torch engine merges adapters itself
    assert not sends_adapters(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"engine": "vllm"})}))   # vLLM gets merged weights


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model.lora.rank=-1"], "model.lora.rank: Input should be greater than or equal to 0"),
    (["model.lora.alpha=0"], "model.lora.alpha: Input should be greater than 0"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["model.lora.target_modules=[\"a.q_proj\"]"], "model.lora.target_modules must be distinct"),
    (["model.lora.target_modules=[\"q_proj\", \"q_proj\"]"], "must be distinct module names"),
    (["model.lora.dropout=0.1"], "model.lora.dropout: unknown key"),
    (["model.lora.rank=8", "learner.backend=deepspeed"],
     "model.lora.rank > 0 needs learner.backend = 'fsdp2' (got 'deepspeed')"),
    (["model.lora.rank=8", "learner.backend=sim"], "needs learner.backend = 'fsdp2'"),
])
def test_bad_lora_config_names_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


# --- wire format ----------------------------------------------------------------------------

def test_split_adapters_pairs_halves_and_keeps_weights() -> None:
    a, b, w = torch.ones(2, 3), torch.zeros(4, 2), torch.ones(5)
    adapters, weights = split_adapters([(adapter_name(Q, "lora_A"), a), ("norm.weight", w),
                                        (adapter_name(Q, "lora_B"), b)])
    assert list(adapters) == [Q] and adapters[Q][0] is a and adapters[Q][1] is b
    assert weights == [("norm.weight", w)]


@pytest.mark.parametrize("names", [[f"{Q}#lora_A"], [f"{Q}#lora_B"], [f"{Q}#lora_C"]])
def test_split_adapters_refuses_incomplete_or_unknown(names: list[str]) -> None:
    with pytest.raises(ValueError):
        split_adapters([(n, torch.ones(1, 1)) for n in names])
    with pytest.raises(ValueError):
        adapter_name(Q, "lora_C")


def test_merge_is_base_plus_b_times_a() -> None:
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    lora_a = torch.tensor([[1.0, -1.0]])           # r = 1, in = 2
    scaled_b = torch.tensor([[2.0], [0.0], [0.5]])  # out = 3
    expected = torch.tensor([[3.0, 0.0], [3.0, 4.0], [5.5, 5.5]])
    torch.testing.assert_close(merge(base, lora_a, scaled_b), expected)
    assert merge(base.bfloat16(), lora_a, scaled_b).dtype == torch.bfloat16


# --- learner merge vs peft ------------------------------------------------------------------

def _tiny() -> torch.nn.Module:
    return build_tiny_model(TinyModelConfig(), len(VOCAB), seed=0)


def _trained_peft(seed: int = 1) -> torch.nn.Module:
    """A peft-wrapped tiny model whose adapters are random (as after training: B ≠ 0)."""
    peft_model = wrap_lora(_tiny(), LORA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return peft_model


def _adapters(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The wire form of a local (unsharded) peft model's adapters, as the learner sends them."""
    from learners.lora import gather_adapters

    return gather_adapters(peft_model, LORA.scale, rank=0)


def test_fresh_adapters_change_nothing() -> None:
    base = _tiny()
    peft_model = wrap_lora(_tiny(), LORA)
    assert not peft_model.training
    merged = merged_state(peft_model.state_dict(), LORA.scale)
    assert set(merged) == set(base.state_dict())
    for name, tensor in base.state_dict().items():
        assert torch.equal(merged[name], tensor), name


def test_merged_state_matches_peft_merge_and_unload() -> None:
    peft_model = _trained_peft()
    with torch.no_grad():
        lora_logits = peft_model(input_ids=PROMPT).logits
    merged = merged_state(peft_model.state_dict(), LORA.scale)
    expected = peft_model.merge_and_unload().state_dict()
    assert list(merged) == list(expected)   # plain HF names, in the base model's order
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    plain = _tiny()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=PROMPT).logits, lora_logits, rtol=0,
                                   atol=1e-5)


def test_adapter_update_carries_only_scaled_adapters() -> None:
    peft_model = _trained_peft()
    update = _adapters(peft_model)
    targets = 2 * 3   # two layers × (q_proj, v_proj, down_proj)
    assert len(update) == 2 * targets and all("#lora_" in n for n in update)
    adapters, weights = split_adapters(update.items())
    assert not weights and Q in adapters
    peft_b = dict(peft_model.named_parameters())[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    torch.testing.assert_close(adapters[Q][1], LORA.scale * peft_b.detach())
    total = sum(p.numel() for p in peft_model.parameters())
    assert sum(t.numel() for t in update.values()) < total / 10   # the point of LoRA


# --- torch engine merge ---------------------------------------------------------------------

def _engine() -> TorchEngine:
    return TorchEngine(_tiny(), eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0)


def _merged(seed: int) -> dict[str, torch.Tensor]:
    return merged_state(_trained_peft(seed).state_dict(), LORA.scale)


@pytest.mark.parametrize("commit", ["load_weights", "adopt_weights"])
def test_engine_merges_adapters_from_its_base_copy(commit: str) -> None:
    engine = _engine()
    for version, seed in enumerate((1, 2, 3), start=1):
        update = _adapters(_trained_peft(seed))
        if commit == "load_weights":
            engine.load_weights(update.items(), version)
        else:
            engine.adopt_weights(dict(update), version)
        expected = _merged(seed)   # W0 + B·A of THIS update: nothing accumulates
        state = engine.state_dict()
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6)
        assert engine.version == version


def test_engine_lora_generation_matches_merged_model() -> None:
    engine, reference = _engine(), _engine()
    engine.load_weights(_adapters(_trained_peft(1)).items(), version=1)
    reference.load_weights(_merged(1).items(), version=1)
    prompts = [PROMPT[0].tolist()]
    got = engine.generate(prompts, n=1, temperature=1.0, max_new_tokens=6, greedy=True)
    want = reference.generate(prompts, n=1, temperature=1.0, max_new_tokens=6, greedy=True)
    assert got[0][0].tokens == want[0][0].tokens
    assert got[0][0].logprobs == pytest.approx(want[0][0].logprobs, abs=1e-5)


def test_bad_adapter_update_changes_nothing() -> None:
    engine = _engine()
    before = engine.state_dict()
    update = _adapters(_trained_peft(1))
    update["model.layers.9.mlp.down_proj.weight#lora_A"] = torch.ones(4, 256)
    update["model.layers.9.mlp.down_proj.weight#lora_B"] = torch.ones(64, 4)
    with pytest.raises(WeightsRefused, match="adapters on unknown weights"):
        engine.load_weights(update.items(), version=1)
    misfit = _adapters(_trained_peft(1))
    misfit[f"{Q}#lora_A"] = torch.ones(4, 7)
    with pytest.raises(WeightsRefused, match="does not fit"):
        engine.load_weights(misfit.items(), version=1)
    assert engine.version == 0
    for name, tensor in engine.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_full_weights_after_adapters_are_the_new_truth() -> None:
    engine = _engine()
    engine.load_weights(_adapters(_trained_peft(1)).items(), version=1)
    full = _merged(2)
    engine.load_weights(full.items(), version=2)
    state = engine.state_dict()
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize(("targets", "expected"), [
    (["lm_head"], "'lm_head' shares its weight with another module (tie_word_embeddings)"),
    (["q_proj", "embed_tokens"], "'model.embed_tokens' is an Embedding, not a linear layer"),
])
def test_targets_a_merge_cannot_serve_are_refused(targets: list[str], expected: str) -> None:
    """The tiny model ties its head to the embeddings: an adapter on either would leave the
    engines with an untied (or unmergeable) copy; refused before peft builds anything."""
    with pytest.raises(ValueError) as info:
        wrap_lora(_tiny(), LoraConfig(rank=4, target_modules=targets))
    assert str(info.value).startswith("model.lora.target_modules: ")
    assert expected in str(info.value)
