"""The learning curve: validation top-1 agreement per draft depth against training tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_curve"]


def plot_curve(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report["curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [c["tokens"] / 1e3 for c in curve]
    for d in range(len(curve[0]["val"])):
        ax.plot(tokens, [c["val"][d] for c in curve], marker=".", label=f"depth {d + 1}")
    ax.set_xlabel("training tokens seen (thousands, all epochs)")
    ax.set_ylabel("validation top-1 agreement with the target")
    n = report.get("train_answer_tokens")
    ax.set_title(f"EAGLE head on {n:,} target-generated tokens" if n else "EAGLE head")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
