"""Write the quickstart's digit-copy task, as text, in verl's Parquet layout, the way verl's
preprocessing scripts (``examples/data_preprocess/gsm8k.py``) write GSM8K:
``python examples/verl/make_data.py [OUT_DIR]`` writes ``OUT_DIR/train.parquet`` and
``OUT_DIR/test.parquet`` (default ``examples/verl/data``, committed). The tiny model's
character tokenizer encodes digits only, so the prompt is the digits themselves; a real
model's recipe uses verl's own files as they are.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

DATA_SOURCE = "asyncrl/digit_copy"


def rows(split: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(4))
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": digits}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": digits},
            "extra_info": {"split": split, "index": index, "question": digits},
        })
    return out


def write(out_dir: Path, train: int = 2048, test: int = 128) -> Path:
    """Both splits, through ``datasets`` as verl does (``Dataset.to_parquet``)."""
    import datasets

    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 0), ("test", test, 1)):
        datasets.Dataset.from_list(rows(split, n, seed)).to_parquet(out_dir / f"{split}.parquet")
    return out_dir


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/verl/data")))
