"""`asyncrl plot RUN_DIR` on a real run's metrics: valid PNGs with curves drawn in them."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np

from asyncrl.cli import main

DATA = Path(__file__).parent / "data"
FIGURES = ("reward", "staleness", "throughput", "idle", "mismatch")


def test_plot_writes_a_png_per_curve(tmp_path: Path, capsys) -> None:
    import matplotlib.image

    run = tmp_path / "quickstart"
    run.mkdir()
    shutil.copy(DATA / "monitor_metrics.jsonl", run / "metrics.jsonl")
    assert main(["plot", str(run)]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert written == [run / "plots" / f"{name}.png" for name in FIGURES]
    for path in written:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (700, 360)
        pixels = matplotlib.image.imread(path)[..., :3]
        colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
        assert len(colours) > 50, path  # antialiased lines and text, not a blank canvas
        # Matplotlib's first line colour (C0, #1f77b4) is drawn: a curve, not only axes.
        c0 = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)
        assert c0.sum() > 200, path


def test_plot_of_a_directory_without_metrics_says_so(tmp_path: Path, capsys) -> None:
    assert main(["plot", str(tmp_path / "nonexist")]) == 1  # one line, no traceback
    assert capsys.readouterr().err == (f"asyncrl: plot: {tmp_path / 'nonexist'}/metrics.jsonl "
                                       f"not found: is {tmp_path / 'nonexist'} a run "
                                       "directory?\n")


def test_plot_draws_a_run_with_null_values(tmp_path: Path, capsys) -> None:
    """orjson writes NaN and inf as null (a diverged step): plot used to fail with
    ``float() argument must be ... not 'NoneType'``; such a point is a gap in its curve."""
    import orjson

    run = tmp_path / "diverged"
    run.mkdir()
    records = [orjson.loads(line) for line in (DATA / "monitor_metrics.jsonl").read_bytes()
               .splitlines()]
    for record in records[2:4]:
        for key in record:
            if key != "step" and isinstance(record[key], float):
                record[key] = None
    (run / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    assert main(["plot", str(run)]) == 0
    assert len(capsys.readouterr().out.split()) == len(FIGURES)
