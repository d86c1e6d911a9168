"""The char tokenizer and the deterministic tiny-model directory every role loads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from asyncrl.config.schema import ModelConfig  # noqa: E402
from asyncrl.models import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    VOCAB,
    build_char_tokenizer,
    load_causal_lm,
    load_tokenizer,
    prepare_model_dir,
)

torch.set_num_threads(1)


def test_vocabulary_ids() -> None:
    assert (PAD_ID, BOS_ID, SEP_ID, EOS_ID) == (0, 1, 2, 3)
    assert VOCAB[4:] == [str(d) for d in range(10)]


def _check_round_trip(tokenizer) -> None:
    ids = tokenizer("<bos>1234<sep>", add_special_tokens=False)["input_ids"]
    assert ids == [BOS_ID, 5, 6, 7, 8, SEP_ID]
    assert tokenizer.decode(ids) == "<bos>1234<sep>"
    assert tokenizer.decode([BOS_ID, 4, 13, EOS_ID], skip_special_tokens=True) == "09"
    assert tokenizer("0099<eos>")["input_ids"] == [4, 4, 13, 13, EOS_ID]
    assert len(tokenizer) == len(VOCAB)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        (BOS_ID, EOS_ID, PAD_ID)


def test_char_tokenizer_round_trip_and_save_load(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = build_char_tokenizer()
    _check_round_trip(tokenizer)
    tokenizer.save_pretrained(tmp_path)
    _check_round_trip(AutoTokenizer.from_pretrained(tmp_path))
    _check_round_trip(load_tokenizer(tmp_path))


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_prepare_model_dir_is_deterministic(tmp_path: Path) -> None:
    cfg = ModelConfig()
    a = prepare_model_dir(cfg, tmp_path / "a", seed=3)
    b = prepare_model_dir(cfg, tmp_path / "b", seed=3)
    c = prepare_model_dir(cfg, tmp_path / "c", seed=4)
    assert a == tmp_path / "a" / "init_model"
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["init_model"]  # no temp dir left


def test_prepare_model_dir_reuses_existing(tmp_path: Path) -> None:
    first = prepare_model_dir(ModelConfig(), tmp_path, seed=0)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_model_dir(ModelConfig(), tmp_path, seed=0) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_prepare_model_dir_passes_explicit_path_through(tmp_path: Path) -> None:
    assert prepare_model_dir(ModelConfig(path="org/some-model"), tmp_path, 0) == \
        Path("org/some-model")
    assert not any(tmp_path.iterdir())


def test_load_causal_lm_and_tokenizer_from_model_dir(tmp_path: Path) -> None:
    path = prepare_model_dir(ModelConfig(), tmp_path, seed=0)
    model = load_causal_lm(path)
    assert not model.training
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id) \
        == (EOS_ID, BOS_ID, PAD_ID)
    saved = _tensors(path)
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    _check_round_trip(load_tokenizer(path))
    assert load_causal_lm(path, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(path, dtype="nonsense")


def _prepare_in_group(rank: int, world: int, device: object, _model_dir: str,
                      out_dir: str) -> None:
    """One rank of a real gloo group: build the initial model dir AFTER joining the group, and
    record what happened (rank 1's save is skipped by transformers, which must be caught)."""
    try:
        path = prepare_model_dir(ModelConfig(), Path(out_dir) / f"rank{rank}", seed=0)
        outcome = "ok" if (path / "config.json").is_file() else "published without a model"
    except RuntimeError as exc:
        outcome = f"refused: {exc}"
    (Path(out_dir) / f"rank{rank}.txt").write_text(outcome)


def test_prepare_model_dir_never_publishes_a_dir_without_the_model(tmp_path: Path) -> None:
    """transformers' save_pretrained writes no weights or config on a torch.distributed rank
    other than 0; such a rank must fail loudly instead of renaming a tokenizer-only directory
    into place for every role to load (the learner now builds it before joining its group)."""
    from tests.unit.test_fsdp2 import spawn_runs

    out = spawn_runs(_prepare_in_group, tmp_path, tmp_path, {"group": (2, ())})["group"]
    assert (out / "rank0.txt").read_text() == "ok"
    assert (out / "rank1.txt").read_text().startswith("refused: ")
    assert "config.json" in (out / "rank1.txt").read_text()
    assert not (out / "rank1" / "init_model").exists()


def test_extra_tokens_stay_in_the_text_a_reward_sees(tmp_path: Path) -> None:
    """``+`` (an extra token) survives ``skip_special_tokens`` decoding after a save and load:
    ``10+1`` reaches the reward as ``10+1``, not ``101``."""
    build_char_tokenizer(["+"]).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode("10+1", add_special_tokens=False)
    assert len(ids) == 4 and tokenizer.convert_ids_to_tokens(ids[2]) == "+"
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == "10+1"


def test_characters_outside_the_vocabulary_are_refused_not_padded() -> None:
    from asyncrl.tokens import encode_strict

    tokenizer = build_char_tokenizer(["+"])
    assert encode_strict(tokenizer, "1+2") == tokenizer.encode("1+2", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"'-x' cannot be encoded .*model.tiny.extra_tokens"):
        encode_strict(tokenizer, "1-2x")


def test_a_prompt_the_tiny_tokenizer_cannot_encode_names_its_sample() -> None:
    from rollouters.tasks.sample import Sample
    from rollouters.workflows.chat import ChatFormat
    from rollouters.workflows.single_turn import SingleTurnWorkflow

    tokenizer = build_char_tokenizer()
    for chat in (None, ChatFormat(tokenizer)):
        workflow = SingleTurnWorkflow(tokenizer, reward=None, chat=chat)
        with pytest.raises(ValueError, match=r"sample row-7 \(data row id\): 'ab' cannot be "
                                             r"encoded"):
            workflow.prompt_tokens(Sample("row-7", "12ab"))
