"""Progress on stderr: timed stages, progress bars for long steps, the final summary table."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TextIO

__all__ = ["Reporter", "ProgressBar", "format_bytes", "format_table"]


class ProgressBar(Protocol):
    """What the pipeline uses of a tqdm bar."""

    def update(self, n: float | None = 1) -> None:
        """Advance by ``n`` steps."""

    def close(self) -> None:
        """Remove the bar."""


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def format_table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned text columns, right-aligned numbers."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(isinstance(r[i], (int, float)) or str(r[i])[:1].isdigit() for r in rows) for i in range(len(headers))
    ]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if numeric[i] and n else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Reporter:
    """Prints `[export] stage ...` lines with timings; records them for the summary."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.timings: list[tuple[str, float]] = []

    def log(self, message: str) -> None:
        """One line on stderr (suppressed when quiet)."""
        if not self.quiet:
            print(f"[export] {message}", file=self.stream, flush=True)

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        """Time a stage: `with ui.stage("load model"): ...`."""
        self.log(f"{label} ...")
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.timings.append((label, elapsed))
        self.log(f"{label}: done in {elapsed:.1f} s")

    def bar(self, total: int, desc: str, unit: str = "it") -> ProgressBar:
        """A tqdm bar on stderr (hidden when quiet or when stderr is not a terminal)."""
        from tqdm.auto import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

        bar: ProgressBar = tqdm(
            total=total,
            desc=f"[export] {desc}",
            unit=unit,
            file=self.stream,
            disable=True if self.quiet else None,
            leave=False,
        )
        return bar
