"""MkDocs hook: adds ``reference/configuration.md``, rendered from the pydantic schema at
build time (:func:`asyncrl.config.reference.config_reference`), so the reference cannot
drift from the code and no generated file is committed."""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from asyncrl.config.reference import config_reference

    files.append(File.generated(config, "reference/configuration.md",
                                content=config_reference()))
    return files
