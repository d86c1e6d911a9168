"""Model and tokenizer construction: the tiny random-init Qwen2 (or Qwen3-MoE) and its
character vocabulary.

Every role (learner ranks, rollout workers) must start from *identical* weights, so the tiny
model is built once, deterministically from the run seed, and saved in HF format under the run
directory; everyone then loads the same files, exactly as they would a real checkpoint.

torch and transformers are imported inside functions: ``asyncrl`` core stays torch-free at import.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from asyncrl.config.schema import ModelConfig, TinyModelConfig

logger = logging.getLogger(__name__)

# transformers resolves its names on first use, and not thread-safely: threads that ask for
# PreTrainedTokenizerFast at once fail with "cannot import name" (every time, with 4 threads,
# here). The simulated engine runs many rollout workers as threads of one process, each
# preparing the model directory and loading its tokenizer as it starts: every import from
# transformers here holds this lock (a one-off, short wait).
_LAZY_IMPORTS = threading.Lock()

SPECIAL: list[str] = ["<pad>", "<bos>", "<sep>", "<eos>"]
DIGITS: list[str] = [str(d) for d in range(10)]
VOCAB: list[str] = SPECIAL + DIGITS
PAD_ID, BOS_ID, SEP_ID, EOS_ID = range(len(SPECIAL))
DIGIT_OFFSET = len(SPECIAL)  # id of "0"; digit d has id DIGIT_OFFSET + d

INIT_MODEL_DIRNAME = "init_model"


# Chat template of the tiny tokenizer: user/tool/system messages end with <sep> (which also
# cues the model's turn), the model's turns with <eos>. Prefix-stable, as multi-turn needs.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}{{ sep_token }}{% endif %}"
    "{% endfor %}")


def build_char_tokenizer(extra_tokens: tuple[str, ...] | list[str] = ()
                         ) -> PreTrainedTokenizerBase:
    """A fast tokenizer over :data:`VOCAB` (+ ``extra_tokens`` after it, e.g. a tool name for
    agent tasks): one token per digit, special and extra tokens matched whole.

    Built in code (no hub download) so the tiny model needs no files beyond the run directory.
    Extra tokens come last, so the ids of :data:`VOCAB` never move. They are ordinary tokens,
    not special ones: decoding with ``skip_special_tokens`` keeps them, so a reward sees
    ``10+1``, not ``101``. A character outside the vocabulary encodes as ``<pad>``, declared
    as the unknown token so that :func:`asyncrl.tokens.encode_strict` can refuse it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    with _LAZY_IMPORTS:
        from transformers import PreTrainedTokenizerFast

    vocab = VOCAB + [t for t in extra_tokens if t not in VOCAB]
    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)},
                                         unk_token="<pad>"))
    # Added (special) tokens are split out before pre-tokenization; what is left is digits.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # "1234", not "1 2 3 4"
    backend.add_special_tokens(SPECIAL)
    backend.add_tokens(vocab[len(VOCAB):])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", sep_token="<sep>",
                                        unk_token="<pad>", padding_side="left")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A random-init ``Qwen2ForCausalLM`` (or ``Qwen3MoeForCausalLM`` when
    ``cfg.num_experts > 0``), identical for identical ``(cfg, vocab_size, seed)``.

    The MoE variant exists so the whole loop (FSDP2 wrapping of expert weights, engines,
    weight sync) runs on a mixture-of-experts architecture in CI, as Qwen3-MoE runs on GPUs.
    The seed is applied inside :func:`torch.random.fork_rng` so the caller's RNG is untouched.
    """
    import torch
    with _LAZY_IMPORTS:
        from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                                  Qwen3MoeForCausalLM)

    shared = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if cfg.num_experts:
        config = Qwen3MoeConfig(**shared, head_dim=cfg.hidden_size // cfg.num_heads,
                                num_experts=cfg.num_experts,
                                num_experts_per_tok=cfg.num_experts_per_tok,
                                moe_intermediate_size=cfg.moe_intermediate_size,
                                decoder_sparse_step=1, norm_topk_prob=True)
        model_cls: Any = Qwen3MoeForCausalLM
    else:
        config = Qwen2Config(**shared)
        model_cls = Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.float().eval()


def prepare_model_dir(model_cfg: ModelConfig, run_dir: Path, seed: int) -> Path:
    """The directory (or hub id) every role loads the initial policy from.

    With ``model_cfg.path`` set it is returned unchanged (a local dir or a hub id, resolved by
    :func:`load_causal_lm`). Otherwise the tiny model and char tokenizer are saved under
    ``run_dir/init_model``: written to a temp dir and renamed, so concurrent callers either
    build identical copies (same seed) and one rename wins, or reuse the finished one. Each role
    process calls it as it starts (the learner, every rollout worker); ``asyncrl up`` does not,
    so it never imports torch: that import cost about 7 s of CPU before any role could start,
    and the tiny model takes well under a second to build.
    """
    if model_cfg.path:
        return Path(model_cfg.path).expanduser()
    run_dir = Path(run_dir)
    final = run_dir / INIT_MODEL_DIRNAME
    if final.is_dir():
        logger.info("reusing initial model at %s", final)
        return final
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{INIT_MODEL_DIRNAME}-", dir=run_dir))
    try:
        _build_tiny(model_cfg.tiny, seed, tmp)
        if not (tmp / "config.json").is_file():  # never publish a model dir without a model
            raise RuntimeError(
                f"saving the initial model to {tmp} wrote no config.json: transformers skips "
                "saving on a torch.distributed rank other than 0; build it before joining a "
                "process group")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model dir is for every role
        os.rename(tmp, final)
        logger.info("initial model (seed %d) saved to %s", seed, final)
    except OSError:
        if not final.is_dir():
            raise
        logger.info("another process built %s first; reusing it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_tiny(cfg: TinyModelConfig, seed: int, directory: Path) -> None:
    """Save the tiny model, its tokenizer and, for a VLM (``cfg.vision.depth > 0``), its image
    processor in ``directory``."""
    if not cfg.vision.depth:
        tokenizer = build_char_tokenizer(cfg.extra_tokens)
        build_tiny_model(cfg, len(tokenizer), seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return
    from asyncrl.vlm import IMAGE_TOKENS, build_tiny_vlm, tiny_image_processor

    tokenizer = build_char_tokenizer([*cfg.extra_tokens, *IMAGE_TOKENS])
    build_tiny_vlm(cfg, tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    tiny_image_processor(cfg).save_pretrained(directory)


def _hub_kwargs(path: str | Path) -> dict[str, Any]:
    """Local directories never touch the network; a hub id goes through the normal resolver
    (which honours ``HF_HUB_OFFLINE`` and the local cache)."""
    return {"local_files_only": True} if Path(path).expanduser().is_dir() else {}


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu"
                   ) -> PreTrainedModel:
    """Load a causal LM (or a vision-language model, :mod:`asyncrl.vlm`) in eval mode, in
    ``dtype`` ("float32", "bfloat16", ...) on ``device``."""
    import torch
    with _LAZY_IMPORTS:
        from asyncrl.vlm import auto_model_class

        model_class = auto_model_class(path)   # a VLM loads as image-text-to-text
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    model = model_class.from_pretrained(str(path), dtype=torch_dtype,
                                                 **_hub_kwargs(path))
    return model.to(device).eval()


def model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in the state of the model class that loads
    ``path`` (:func:`load_causal_lm`'s, the learner's too), tied names included: what a weight
    update for it may carry (:func:`asyncrl.weights.fit.check_fit`). Built on the meta device,
    so no memory is allocated and no weight file is read."""
    import torch
    with _LAZY_IMPORTS:
        from transformers import AutoConfig

        from asyncrl.vlm import auto_model_class

        model_class = auto_model_class(path)
        config = AutoConfig.from_pretrained(str(path), **_hub_kwargs(path))
    with torch.device("meta"):
        model = model_class.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def attention_head_dim(config: Any) -> int:
    """The attention head size of an HF config (a vision-language model's: its text
    model's): ``head_dim`` where the config says it, else hidden size / heads."""
    text = config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside a model (the char tokenizer for the tiny model).

    A directory whose ``tokenizer_config.json`` declares the generic ``TokenizersBackend`` is
    loaded exactly as its ``tokenizer.json`` says: ``AutoTokenizer`` would otherwise pick the
    class registered for ``config.json``'s model type (``Qwen2Tokenizer`` for the tiny model),
    which rebuilds the pipeline and adds ``<|endoftext|>`` beyond the model's vocabulary.
    """
    with _LAZY_IMPORTS:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        start = time.monotonic()  # after the import: a process's first one takes seconds
        kwargs = _hub_kwargs(path)
        if _declared_tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    # One line per load: a process that logs two loaded a tokenizer it already had.
    logger.info("tokenizer of %s loaded in %.2fs", path, time.monotonic() - start)
    return tokenizer


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_tokenizer_class(path: str | Path) -> str | None:
    """``tokenizer_class`` from a local ``tokenizer_config.json`` (None for hub ids)."""
    config_file = Path(path).expanduser() / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("tokenizer_class")
