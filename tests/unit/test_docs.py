"""The documentation points only at files that exist.

README.md, docs/, bench/RESULTS.md and deploy/README.md name source files, tests and configs
(as Markdown links or in backticks) so that a reader can go there. A file that moved or went
leaves a pointer to nothing; an earlier README linked files that were never in the
repository. Each such pointer is named with its file and line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", ROOT / "deploy" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("asyncrl", "buffers", "learners", "rollouters", "tests", "bench", "configs", "deploy",
       "examples", "docs")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
PATH = re.compile(rf"^(?:{'|'.join(TOP)})/[\w./-]*$")
# Pages the site generates at build time (docs/_hooks/): linked, never committed.
GENERATED = {ROOT / "docs" / "reference" / "configuration.md"}


def _targets(doc: Path) -> list[tuple[int, Path]]:
    """``(line, path)`` for every repository path the document points at."""
    found = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for link in LINK.findall(line):
            if "://" not in link and not link.startswith(("#", "mailto:")):
                found.append((number, (doc.parent / link.split("#")[0]).resolve()))
        for code in CODE.findall(line):
            path = code.split("::")[0].rstrip(".,:;")
            if PATH.match(path) and "<" not in path and "*" not in path:
                found.append((number, ROOT / path))
    return found


def test_every_path_the_docs_name_exists() -> None:
    missing = [f"{doc.relative_to(ROOT)}:{line}: {target.relative_to(ROOT)}"
               for doc in DOCS for line, target in _targets(doc)
               if target.is_relative_to(ROOT) and not target.exists()
               and target not in GENERATED]
    assert not missing, "the docs point at files that do not exist:\n" + "\n".join(missing)


def test_every_doc_is_reachable_from_the_readme() -> None:
    """A page nobody links to is a page nobody reads."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [doc.name for doc in sorted((ROOT / "docs").glob("*.md"))
                if f"(docs/{doc.name})" not in readme]
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


def test_the_site_builds_strict_with_the_generated_reference(tmp_path: Path) -> None:
    """`mkdocs build --strict` (mkdocs is in the `dev` extra): any broken link between pages,
    page left out of the nav or warning fails it; the reference page is generated."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "buffer.zmq" in page and "max_staleness" in page


def test_the_reference_names_every_key_of_the_schema() -> None:
    from asyncrl.config.reference import config_reference, sections

    text = config_reference()
    for table, model in sections():
        assert f"## `[{table}]`" in text
        for name, field in model.model_fields.items():
            if not hasattr(field.annotation, "model_fields"):
                assert f"| `{name}` |" in text, f"{table}.{name}"
