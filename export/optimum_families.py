"""Which checkpoint folders `python -m export` builds through optimum (`export.optimum_path`):
the model types optimum-onnx exports as causal LMs with a KV cache that no native family and
no refusal by name and reason covers. Kept apart from `export.optimum_path`, which imports
`export.source`, so `export.source` can ask."""

from __future__ import annotations

import functools
from typing import Any

from .model_spec import SUPPORTED_FAMILIES, refusal_reason

__all__ = ["OPTIMUM_TASK", "optimum_families", "optimum_builds"]

OPTIMUM_TASK = "text-generation-with-past"


@functools.cache
def optimum_families() -> tuple[str, ...]:
    """The model types optimum-onnx exports for ``text-generation-with-past`` that transformers
    knows and no native family or refusal covers, sorted; () without optimum-onnx."""
    try:
        import optimum.exporters.onnx.model_configs  # noqa: F401 - registers optimum's ONNX configs
        from optimum.exporters.tasks import TasksManager
        from transformers import CONFIG_MAPPING
    except ImportError:
        return ()
    types = TasksManager.get_supported_model_type_for_task(OPTIMUM_TASK, exporter="onnx")
    return tuple(
        sorted(
            t
            for t in types
            if t not in SUPPORTED_FAMILIES and t in CONFIG_MAPPING and refusal_reason(t, SUPPORTED_FAMILIES) is None
        )
    )


def optimum_builds(family: object, config: dict[str, Any] | None) -> bool:
    """Whether a checkpoint folder of ``family`` (``config``: its config.json) is built through
    optimum: not native, nothing known against it, and one of :func:`optimum_families`."""
    return (
        isinstance(family, str)
        and family not in SUPPORTED_FAMILIES
        and refusal_reason(family, SUPPORTED_FAMILIES, config) is None
        and family in optimum_families()
    )
