"""Real model layouts (Llama, GPT-2, a BPE tokenizer with ChatML): their own EOS, pad and
decoder blocks are what the engines, eval and the learner use, not the tiny tokenizer's ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig
from asyncrl.tokens import SpecialTokens, special_tokens, tokens_of
from tests.real_models import ENDOFTEXT, IM_END, bpe_tokenizer, save_model_dir
from tests.unit.test_fsdp2 import make_groups, spawn_runs

EOS_IDS = (IM_END, ENDOFTEXT)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real")
    return {arch: save_model_dir(root / arch, arch) for arch in ("llama", "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_special_tokens_come_from_the_model_files(model_dirs: dict[str, Path], arch: str) -> None:
    special = special_tokens(model_dirs[arch])
    # Every id of generation_config's eos_token_id, the tokenizer's first; its pad; no BOS.
    assert special == SpecialTokens(eos_ids=EOS_IDS, pad_id=ENDOFTEXT, bos_id=None)
    assert 3 not in special.eos_ids


def test_the_tiny_model_keeps_its_ids(tmp_path: Path) -> None:
    from asyncrl.config.schema import ModelConfig
    from asyncrl.models import BOS_ID, EOS_ID, PAD_ID, prepare_model_dir

    special = special_tokens(prepare_model_dir(ModelConfig(), tmp_path, seed=0))
    assert special == SpecialTokens(eos_ids=(EOS_ID,), pad_id=PAD_ID, bos_id=BOS_ID)


def test_a_model_without_pad_pads_with_eos_and_one_without_eos_is_refused() -> None:
    tokenizer = bpe_tokenizer()
    tokenizer.pad_token = None
    assert tokens_of(tokenizer, {"eos_token_id": [IM_END]}).pad_id == IM_END
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        tokens_of(tokenizer, {})


def test_cut_keeps_the_first_eos_and_nothing_after() -> None:
    special = SpecialTokens(eos_ids=EOS_IDS, pad_id=ENDOFTEXT)
    assert special.cut([5, 3, IM_END, 7]) == ([5, 3, IM_END], True)
    assert special.cut([5, 3, 7]) == ([5, 3, 7], False)


def test_torch_engine_stops_at_any_of_the_models_eos_ids(model_dirs: dict[str, Path]) -> None:
    """Sampled from a random-init Llama (nearly uniform over ~320 tokens): rows end at either
    EOS id with finish reason "stop", nothing follows an EOS, and the byte token 3, which the
    tiny tokenizer would take for its EOS, does not end a row."""
    from asyncrl.models import load_causal_lm, load_tokenizer
    from rollouters.engines.torch_engine import TorchEngine

    special = special_tokens(model_dirs["llama"])
    engine = TorchEngine(load_causal_lm(model_dirs["llama"]), eos_ids=special.eos_ids,
                         pad_id=special.pad_id, seed=0)
    tokenizer = load_tokenizer(model_dirs["llama"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text)
    (rows,) = engine.generate([prompt], n=48, temperature=1.5, max_new_tokens=96)
    ends = set()
    for row in rows:
        assert len(row.tokens) == len(row.logprobs) == len(row.versions)
        assert not set(row.tokens[:-1]) & set(EOS_IDS)   # nothing after an EOS
        if row.finish_reason == "stop":
            ends.add(row.tokens[-1])
        else:
            assert row.finish_reason == "length" and len(row.tokens) == 96
    assert ends == set(EOS_IDS)   # both ids end rows
    assert any(3 in row.tokens[:-1] for row in rows)   # an ordinary token here


def test_decoder_blocks_are_found_by_class_or_refused_naming_the_backend(
        model_dirs: dict[str, Path]) -> None:
    from asyncrl.models import load_causal_lm
    from learners.backends.fsdp2 import decoder_blocks

    assert decoder_blocks(load_causal_lm(model_dirs["llama"])) == [
        "model.layers.0", "model.layers.1"]
    assert decoder_blocks(load_causal_lm(model_dirs["gpt2"])) == [
        "transformer.h.0", "transformer.h.1"]
    with pytest.raises(ValueError, match='learner.backend = "fsdp2" cannot shard Sequential'):
        decoder_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def _train_arch(rank: int, world: int, device: torch.device, _: str, out_dir: str,
                model_dir: str, checkpointing: bool) -> None:
    """Two FSDP2 steps on ``model_dir`` (its blocks sharded), saving the step metrics."""
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.batching import collate

    cfg = LearnerConfig(lr=1e-3, activation_checkpointing=checkpointing)
    trainer = Fsdp2Trainer(model_dir, cfg, device)
    batch = collate(make_groups(), std_norm=True, pad_id=ENDOFTEXT)
    metrics = [trainer.train_step(batch) for _ in range(2)]
    torch.save({"metrics": metrics, "state": trainer.full_state_dict()},
               Path(out_dir) / "out.pt")


def test_fsdp2_shards_and_trains_llama_and_gpt2(model_dirs: dict[str, Path],
                                                tmp_path: Path) -> None:
    """Each architecture with and without activation checkpointing (which replaces the
    blocks by wrappers), the four runs in turn in one learner process."""
    runs = {f"{arch}-{ckpt}": (1, (str(model_dirs[arch]), ckpt)) for arch in ("llama", "gpt2")
            for ckpt in (False, True)}
    for name, out in spawn_runs(_train_arch, model_dirs["llama"], tmp_path, runs).items():
        metrics = torch.load(out / "out.pt", weights_only=False)["metrics"]
        assert all(torch.isfinite(torch.tensor(m["actor/loss"])) for m in metrics), name
        assert metrics[0]["actor/grad_norm"] > 0, name
        assert metrics[1]["actor/loss"] != metrics[0]["actor/loss"], name   # it stepped
