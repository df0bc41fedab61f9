"""Writing a tool's report: one place for ``bench``, ``bench --concurrency`` and ``loadtest``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report"]


def write_report(out: Path, stem: str, report: dict, markdown: str, table: str, as_json: bool) -> None:
    """``out/stem.json`` (the report) and ``out/stem.md`` (``markdown``); on stdout the report as
    one JSON document (``as_json``) or else ``table``."""
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(markdown.rstrip("\n") + "\n")
    print(json.dumps(report) if as_json else table)
