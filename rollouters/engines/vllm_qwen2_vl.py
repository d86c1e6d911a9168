"""vLLM's Qwen2-VL where torchvision is not installed (the CPU install): images only.

vLLM 0.32's ``qwen2_vl.py`` imports ``smart_resize`` from transformers'
``image_processing_qwen2_vl``, which imports torchvision at its top (transformers 5.19, line
26); and vLLM builds Qwen2-VL's HF processor with a video processor that requires torchvision.
The CPU install has no torchvision (the PyPI builds are CUDA builds that cannot load against
CPU torch: the Makefile uninstalls them), so vLLM cannot import the model at all.

:func:`install` makes both work without torchvision, changing nothing where it is installed:
the module vLLM imports gets a stand-in holding transformers' own PIL ``smart_resize`` and PIL
image processor (the same resize rule, "Copied from" the torchvision one), and vLLM's
``Qwen2VLProcessor`` is :class:`ImageOnlyQwen2VLProcessor` (tokenizer + PIL image processor,
no video processor: videos are refused). It must run in every process that imports vLLM's
model, and importing this module runs it. The processes and how each comes to import it:

- the engine's own: :func:`register`, before vLLM starts;
- vLLM's model-inspection subprocess: it imports :data:`ARCHITECTURE_CLASS`, this module
  (:func:`register` points the registry here);
- the spawned engine core (AsyncLLM) and its worker processes: they unpickle the engine's
  config, whose ``hf_overrides`` is :func:`keep_config`, a function of this module (pickled by
  reference, so unpickling imports the module first); the worker extension
  (:mod:`vllm_extension`) installs it too.

vLLM's own mechanism for code in every process is a general plugin, an entry point of an
installed package: that needs the package reinstalled to take effect, this does not.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from typing import Any, TypedDict

logger = logging.getLogger(__name__)

ARCHITECTURE = "Qwen2VLForConditionalGeneration"
ARCHITECTURE_CLASS = f"{__name__}:{ARCHITECTURE}"
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_installed = False


def needed() -> bool:
    """Is torchvision missing (so vLLM's Qwen2-VL cannot import without :func:`install`)?"""
    return importlib.util.find_spec("torchvision") is None


def install() -> None:
    """Make vLLM's Qwen2-VL importable and its processor buildable without torchvision;
    idempotent, and nothing where torchvision is installed."""
    global _installed
    if _installed or not needed():
        return
    import transformers.models.qwen2_vl as qwen2_vl
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    stand_in = types.ModuleType(_TORCHVISION_MODULE)
    stand_in.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    stand_in.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    sys.modules.setdefault(_TORCHVISION_MODULE, stand_in)
    qwen2_vl.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    qwen2_vl.Qwen2VLProcessor = _image_only_processor()
    _installed = True
    logger.debug("vLLM's Qwen2-VL set up without torchvision (images only)")


def _image_only_processor() -> type:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor with the PIL image processor and no video processor."""

        @classmethod
        def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
            revision = kwargs.get("revision")
            tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
            images = Qwen2VLImageProcessorPil.from_pretrained(path, revision=revision)
            return cls(image_processor=images, tokenizer=tokenizer,
                       video_processor=NoVideoProcessor(images.merge_size),
                       chat_template=getattr(tokenizer, "chat_template", None))

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if isinstance(argument, NoVideoProcessor):
                return NoVideoProcessor
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor


class _NoVideoKwargs(TypedDict, total=False):
    """The video kwargs a processor without videos takes: none."""


class NoVideoProcessor:
    """The video processor's place in :class:`ImageOnlyQwen2VLProcessor`: vLLM reads its
    ``valid_kwargs`` and ``merge_size``; a video is an error naming the missing torchvision."""

    valid_kwargs = _NoVideoKwargs

    def __init__(self, merge_size: int) -> None:
        self.merge_size = merge_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("videos need torchvision, which is not installed (images only)")


def keep_config(config: Any) -> Any:
    """``hf_overrides`` for a VLM's engine: the config unchanged. It is there to be pickled
    into every vLLM process, which then imports this module (and so :func:`install`)."""
    return config


def register() -> None:
    """Point vLLM's registry at this module for Qwen2-VL (after :func:`install`), so vLLM's
    model-inspection subprocess, which imports the class, installs the stand-ins first."""
    if not needed():
        return
    install()
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, ARCHITECTURE_CLASS)


def __getattr__(name: str) -> Any:
    """``Qwen2VLForConditionalGeneration``: vLLM's class, imported after :func:`install`."""
    if name != ARCHITECTURE:
        raise AttributeError(name)
    install()
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration


install()  # whoever imports this module (an unpickled keep_config, the inspection subprocess)
