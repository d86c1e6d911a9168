"""verl's data layout read as it is: chat-message prompts, the ground truth under
reward_model, data_source and extra_info on the sample, dotted field paths, a save_to_disk
directory, and a hub id that cannot be reached here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.models import build_char_tokenizer
from examples.verl.make_data import DATA_SOURCE, rows, write
from rollouters.tasks.data import DatasetSource, check_data_file, load_rows, row_to_sample
from rollouters.workflows.chat import ChatFormat
from rollouters.workflows.single_turn import SingleTurnWorkflow

GSM8K_ROW = {  # as verl's examples/data_preprocess/gsm8k.py writes one
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Natalia sold 48 clips. Let's think step by step "
                                           "and output the final answer after \"####\"."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "... #### 72",
                   "question": "Natalia sold 48 clips."},
}


def _data(path: Path, *overrides: str):
    return load_config(None, [f"data.path={path}", "workflow.type=single_turn",
                              *overrides]).data


def _gsm8k_parquet(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list([GSM8K_ROW, {**GSM8K_ROW, "reward_model": {
        "style": "rule", "ground_truth": "5"}}]).to_parquet(path)
    return path


def test_a_verl_parquet_needs_no_data_setting(tmp_path: Path) -> None:
    path = _gsm8k_parquet(tmp_path / "train.parquet")
    data = _data(path)
    assert check_data_file(path, data.format, data.split, data) == 2
    sample = DatasetSource(load_rows(path, data=data), data, state_path=None).samples[0]
    assert sample.messages == GSM8K_ROW["prompt"]
    assert sample.answer == "72"   # reward_model.ground_truth
    assert sample.fields["data_source"] == "openai/gsm8k"
    assert sample.fields["extra_info"]["index"] == 0


def test_the_messages_go_through_the_chat_template(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    data = _data(tmp_path / "x.parquet")
    sample = row_to_sample(rows("train", 1, 0)[0], 0, data)
    workflow = SingleTurnWorkflow(tokenizer, reward=None, chat=ChatFormat(tokenizer),
                                  system_prompt="")
    text = tokenizer.decode(workflow.prompt_tokens(sample))
    assert text == f"<bos>{sample.messages[0]['content']}<sep>"   # the tiny model's template
    plain = SingleTurnWorkflow(tokenizer, reward=None, chat=None)
    with pytest.raises(ValueError, match="workflow.chat_template = false"):
        plain.prompt_tokens(sample)


def test_dotted_fields_and_the_verl_format_said_explicitly(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"q": "12", "meta": {"gt": "21", "id": "a"}}) + "\n")
    data = _data(path, "data.prompt_template={q}", "data.answer_field=meta.gt",
                 "data.id_field=meta.id")
    sample = row_to_sample(load_rows(path, data=data)[0], 0, data)
    assert (sample.prompt, sample.answer, sample.sample_id, sample.messages) == \
        ("12", "21", "a", None)
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: 'prompt' is not a non-empty list of "
                                          r"chat messages \(verl's layout: data.format = 'verl'"):
        load_rows(path, data=_data(path, "data.format=verl"))
    missing = _data(path, "data.prompt_template={q}", "data.answer_field=meta.nope")
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: no field 'meta.nope' \(named by "
                                          r"data.answer_field"):
        load_rows(path, data=missing)


def test_a_save_to_disk_directory_reads_the_same(tmp_path: Path) -> None:
    import datasets

    write(tmp_path / "parquet", train=8, test=2)
    directory = tmp_path / "saved"
    datasets.Dataset.from_list(rows("train", 8, 0)).save_to_disk(str(directory))
    data = _data(directory)
    from_disk = [row_to_sample(r, i, data) for i, r in enumerate(load_rows(directory, data=data))]
    from_parquet = [row_to_sample(r, i, data) for i, r in enumerate(
        load_rows(tmp_path / "parquet" / "train.parquet", data=data))]
    assert [(s.messages, s.answer) for s in from_disk] == \
        [(s.messages, s.answer) for s in from_parquet]
    assert {s.fields["data_source"] for s in from_disk} == {DATA_SOURCE}


def test_a_hub_id_is_loaded_through_datasets_and_fails_naming_the_key() -> None:
    """No hub is reachable here: offline, the id goes to ``datasets.load_dataset`` (a local
    file of that name would be read instead) and its failure names the key. In a process of
    its own: ``datasets`` reads the offline switch when it is first imported."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", "from rollouters.tasks.data import load_rows\n"
                               "load_rows('asyncrl-test/no-such-set', split='train')"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=120)
    assert done.returncode != 0
    assert ("ConfigError: data.path: 'asyncrl-test/no-such-set' is no local file, and loading "
            "it as a hub dataset (split 'train', data.split) failed") in done.stderr
