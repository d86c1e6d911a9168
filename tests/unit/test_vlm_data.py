"""``data.image_field``: a row's images (file paths, or verl's ``images`` column of
``{bytes, path}`` in Parquet) become the sample's, the single-turn workflow places them where
the prompt marks ``<image>`` (or before its text) and expands them as the processor does, the
engine generates from them and the group carries them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl import vlm
from asyncrl.config.schema import DataConfig
from asyncrl.wire.images import group_images
from tests.unit.test_vlm import solid, vlm_dir  # noqa: F401  (the module's tiny VLM fixture)


class Constant:
    async def score(self, text: str, sample) -> float:
        return 1.0

    def close(self) -> None:
        pass


def _workflow(model_dir: Path):
    from asyncrl.models import load_tokenizer
    from rollouters.workflows.chat import ChatFormat
    from rollouters.workflows.single_turn import SingleTurnWorkflow

    tokenizer = load_tokenizer(model_dir)
    return SingleTurnWorkflow(tokenizer, Constant(), ChatFormat(tokenizer, [3]),
                              images=vlm.PromptImages.of(model_dir))


def _samples(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollouters.tasks.data import load_rows, row_to_sample

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    red.write_bytes(solid((255, 0, 0)))
    blue.write_bytes(solid((0, 0, 255)))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"prompt": "12<image>3<image>", "answer": "1",
                                 "img": [str(red), str(blue)]}) + "\n")
    parquet = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": "7"}], "data_source": "colours",
        "reward_model": {"ground_truth": "3"},
        "images": [{"bytes": solid((0, 0, 255)), "path": None}]}]), parquet)
    text = DataConfig(path=str(jsonl), image_field="img")
    verl = DataConfig(path=str(parquet), image_field="images")
    return (row_to_sample(load_rows(jsonl, data=text)[0], 0, text),
            row_to_sample(load_rows(parquet, data=verl)[0], 0, verl))


def test_rows_images_reach_the_engine_and_the_group(vlm_dir: Path, tmp_path: Path) -> None:
    from asyncrl.models import load_causal_lm, load_tokenizer
    from rollouters.engines.torch_engine import TorchEngine
    from rollouters.workflows.api import group_from_trajectories
    from rollouters.workflows.batching import BatchingEngine

    text, verl = _samples(tmp_path)
    assert len(text.images) == 2 and verl.images == (solid((0, 0, 255)),)
    workflow = _workflow(vlm_dir)
    tokenizer = load_tokenizer(vlm_dir)
    spec = vlm.vision_spec(vlm_dir)
    marked = tokenizer.decode(workflow.prompt_tokens(text))
    assert "12" + vlm.IMAGE_PLACEHOLDER + "3" + vlm.IMAGE_PLACEHOLDER + "<sep>" in marked
    with pytest.raises(ValueError, match="sample 0 .*1 image placeholders for 2 images"):
        workflow.prompt_tokens(replace(text, prompt="12<image>"))
    ids = workflow.prompt_tokens(verl)   # no mark: the image before the user's text
    assert tokenizer.decode(ids).startswith("<bos>" + vlm.IMAGE_PLACEHOLDER + "7")
    assert ids.count(spec.image_token_id) == 1   # 28²: one token an image
    engine = TorchEngine(load_causal_lm(vlm_dir), eos_ids=[3], pad_id=0, seed=0,
                         image_processor=vlm.load_image_processor(vlm_dir))

    async def episodes():
        batching = BatchingEngine(engine, temperature=1.0, max_new_tokens=3)
        return await asyncio.gather(*(workflow.run_episode(batching, verl) for _ in range(2)))

    trajectories = asyncio.run(episodes())
    group = group_from_trajectories("g", verl.sample_id, trajectories)
    assert group_images(group) == list(verl.images)
    assert group.tokens[:len(ids)].tolist() == ids


def test_an_image_field_the_row_lacks_is_named(tmp_path: Path) -> None:
    from asyncrl.config.errors import ConfigError
    from rollouters.tasks.data import row_to_sample

    cfg = DataConfig(image_field="img")
    with pytest.raises(ConfigError, match="no field 'img' \\(named by data.image_field"):
        row_to_sample({"prompt": "1", "answer": "1"}, 0, cfg)
    with pytest.raises(ConfigError, match="image 'nowhere.png' of data.image_field"):
        row_to_sample({"prompt": "1", "answer": "1", "img": "nowhere.png"}, 0, cfg)
