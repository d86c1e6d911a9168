"""HF exports (``final/``, ``hf/step_<V>``) written whole, then swapped in.

Why: ``save_pretrained`` writes into its directory file by file. A learner killed during an
export (the final one is written after the last step, and a resumed run writes it again)
left a directory with a ``config.json`` and truncated or missing weights: it looked like a
model, and ``from_pretrained`` or an engine then failed on it; and a re-export into it kept
the files of the old one that ``save_pretrained`` does not replace (it removes its own stale
shards, not, say, a LoRA adapter's ``adapter_config.json``). Written to a sibling and
renamed, the directory is always either the previous export or the new one, whole.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path


def replace_dir(path: str | Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a fresh sibling ``.<name>.tmp``, then put it in place of ``path``
    (the previous directory, if any, is removed once the new one is there). A write that
    raises leaves ``path`` as it was; a writer killed mid-write leaves its ``.tmp``, removed
    by the next call. Killed between the two renames, the new directory is at ``.tmp`` and
    the old at ``.old``, both whole. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, path, path.with_name(f".{path.name}.old"))
    return path


def swap_in(tmp: Path, path: Path, old: Path) -> None:
    """Put the complete directory ``tmp`` in place of ``path``: the one there, if any, is
    renamed to ``old`` first and removed only once the new one is in place (a leftover
    ``old`` of a killed call goes first). Killed between the two renames, the new directory
    is at ``tmp`` and the previous one at ``old``, both whole; never neither."""
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
