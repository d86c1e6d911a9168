"""Rollout workers of the simulated engine are threads of one process, each loading its
tokenizer as it starts. transformers resolves ``PreTrainedTokenizerFast`` lazily and not
thread-safely: concurrent first loads failed with "cannot import name" (4 threads, every try).
Half the threads build the tiny model's tokenizer instead (what a worker does when it
prepares the model directory). A fresh interpreter, so nothing is resolved before the threads
start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrl.models import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]

RACE = """
import sys, threading
from asyncrl.models import build_char_tokenizer, load_tokenizer
errors, loaded = [], []
def load(build):
    try:
        tokenizer = build_char_tokenizer() if build else load_tokenizer(sys.argv[1])
        loaded.append(tokenizer.vocab_size)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=load, args=(i % 2,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(errors or loaded)
sys.exit(1 if errors else 0)
"""


def test_threads_load_their_tokenizers_at_once(tmp_path: Path) -> None:
    build_char_tokenizer().save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-c", RACE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
