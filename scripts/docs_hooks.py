"""MkDocs hook: adds the reference pages (settings, routes, metrics, architectures, protocol messages) as the site
builds, each written from the code it describes by neuron/cli/reference.py, so that no page can drift from it."""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files

from neuron.cli.reference import PAGES


def on_files(files: Files, config: Any) -> Files:
    for path, write in PAGES.items():
        files.append(File.generated(config, path, content=write()))
    return files
