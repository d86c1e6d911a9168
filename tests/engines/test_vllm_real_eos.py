"""vLLM on a real model layout (Llama, BPE tokenizer, two EOS ids in generation_config.json):
rows end at the model's own EOS ids with finish reason "stop", and nothing follows an EOS."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.tokens import special_tokens
from tests.real_models import ENDOFTEXT, IM_END, save_model_dir


@pytest.fixture(scope="module")
def llama_engine(vllm_env: dict[str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    import torch

    from rollouters.engines.vllm_engine import VLLMEngine, VLLMOptions

    torch.set_num_threads(1)
    model_dir = save_model_dir(tmp_path_factory.mktemp("llama") / "model", "llama")
    engine = VLLMEngine(model_dir, VLLMOptions(eos_ids=special_tokens(model_dir).eos_ids,
                                               seed=0))
    try:
        yield engine, model_dir
    finally:
        engine.close()


def test_vllm_stops_at_any_of_the_models_eos_ids(llama_engine: tuple[object, Path]) -> None:
    from asyncrl.models import load_tokenizer

    engine, model_dir = llama_engine
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                         add_generation_prompt=True, tokenize=False)
    (rows,) = engine.generate([tokenizer.encode(text)], n=48, temperature=1.5,
                              max_new_tokens=96)
    ends = set()
    for row in rows:
        assert not {IM_END, ENDOFTEXT} & set(row.tokens[:-1])   # nothing after an EOS
        if row.finish_reason == "stop":
            ends.add(row.tokens[-1])
        else:
            assert row.finish_reason == "length" and len(row.tokens) == 96
    assert ends == {IM_END, ENDOFTEXT}
    assert any(3 in row.tokens[:-1] for row in rows)   # the tiny tokenizer's EOS id: ordinary
