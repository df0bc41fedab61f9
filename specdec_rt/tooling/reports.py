"""Writing a tool's report: one place for ``bench``, ``bench --concurrency`` and ``loadtest``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report", "pyplot", "save_figure"]


def write_report(
    out: Path, stem: str, report: dict[str, Any], markdown: str, *, table: str | None = None, as_json: bool = False
) -> None:
    """``out/stem.json`` (the report) and ``out/stem.md`` (``markdown``); on stdout the report as
    one JSON document (``as_json``) or else ``table`` (default: ``markdown``)."""
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(markdown.rstrip("\n") + "\n")
    print(json.dumps(report) if as_json else markdown if table is None else table)


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the non-interactive Agg backend, or None when matplotlib is not
    installed (a report then has no chart)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, 110 dpi) and free it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
