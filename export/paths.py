"""Where fetched wheels and built models live (the runtime applies the same rule).

root      = $SPECDEC_RT_CACHE, else $XDG_CACHE_HOME/specdec-rt, else ~/.cache/specdec-rt
downloads = <root>/downloads/            wheels and assembled GGUF files
models    = <root>/models/<recipe-name>/ a built target (drafts in draft-<name>/ inside)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_rt.manifest_schema import CACHE_ENV

if TYPE_CHECKING:
    from .errors import ExportError

__all__ = ["CACHE_ENV", "cache_root", "downloads_dir", "model_dir", "inside"]


def cache_root() -> Path:
    """The cache root; nothing is created."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specdec-rt"


def downloads_dir() -> Path:
    """Folder for wheels and the files assembled from them."""
    return cache_root() / "downloads"


def model_dir(name: str) -> Path:
    """Folder a recipe's built target goes to: `<root>/models/<name>`."""
    return cache_root() / "models" / name


def inside(root: Path, name: str | os.PathLike[str], what: str, error: type[ExportError] | None = None) -> Path:
    """`root / name` resolved (symlinks followed), which must lie strictly inside `root`;
    else `error` (default `SourceNotFoundError`) naming `what`. Used for every path that comes
    from a recipe or a manifest, so none can reach outside its folder."""
    from .errors import SourceNotFoundError

    base = Path(root).resolve()
    path = (base / name).resolve()
    if path == base or not path.is_relative_to(base):
        raise (error or SourceNotFoundError)(f"{what} {str(name)!r} points outside {root}")
    return path
