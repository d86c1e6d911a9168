"""Local model directories laid out as real Hugging Face checkpoints, built in code.

No hub is reachable here, so the tests that check how a *real* model is handled build one:
a byte-level BPE tokenizer trained with ``tokenizers`` on a small corpus, a ChatML chat
template, ``<|im_end|>`` as the tokenizer's EOS and ``<|endoftext|>`` as its pad, and a
``generation_config.json`` that lists both as EOS ids (as Qwen2.5-Instruct's does). The id 3
is an ordinary byte token, unlike the tiny tokenizer's ``<eos>``. Models are random-init
Llama or GPT-2 of a few hundred thousand parameters (head dim 32, which vLLM's CPU backend
needs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = range(len(SPECIALS))
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(30) for b in range(30)]


def bpe_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML and Qwen-like specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    assert tokenizer.convert_tokens_to_ids(SPECIALS) == [ENDOFTEXT, IM_START, IM_END]
    return tokenizer


def save_model_dir(path: Path, arch: str, seed: int = 0) -> Path:
    """A random-init ``arch`` ("llama" or "gpt2") with the BPE tokenizer, saved to ``path``."""
    import torch
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = bpe_tokenizer()
    vocab = len(tokenizer)
    ids = {"bos_token_id": None, "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                tie_word_embeddings=False, **ids))
        elif arch == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=2,
                                               n_positions=256, **ids))
        else:
            raise ValueError(arch)
    model.generation_config = GenerationConfig(eos_token_id=[IM_END, ENDOFTEXT],
                                               pad_token_id=ENDOFTEXT)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
