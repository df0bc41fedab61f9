"""ONNX Runtime backends: models from ``python -m export`` folders behind the scheduler's Protocols."""

from __future__ import annotations

import os
from typing import Any

from ..speculation.adapters import ModelDrafter, ModelVerifier
from .manifest import Manifest, load_manifest, resolve_model_dir
from .model import KVPool, OrtModel, OrtSession, default_threads, use_global_thread_pool

__all__ = [
    "OrtTargetVerifier",
    "OrtDraftInferrer",
    "OrtModel",
    "OrtSession",
    "KVPool",
    "Manifest",
    "load_manifest",
    "resolve_model_dir",
    "default_threads",
    "use_global_thread_pool",
]


class OrtTargetVerifier(ModelVerifier):
    """The target: verifies k drafts in one ONNX Runtime call (k+1 logits rows)."""

    model: OrtModel

    def __init__(
        self, model: OrtModel | str | os.PathLike[str] | Manifest, *, share_hidden: bool = False, **options: Any
    ) -> None:
        """A verifier over an ONNX Runtime target.

        Args:
            model: An :class:`OrtModel`, or a folder / manifest to build one from.
            share_hidden: Keep the target's hidden states for an EAGLE drafter (see
                ``ModelVerifier``).
            **options: :class:`OrtModel`'s options, when ``model`` is a folder or manifest.

        Raises:
            ModelLoadError: The folder cannot be loaded.
            InvalidInputError: ``share_hidden`` with a model that returns no hidden states.
        """
        super().__init__(
            model if isinstance(model, OrtModel) else OrtModel(model, **options), share_hidden=share_hidden
        )


class OrtDraftInferrer(ModelDrafter):
    """A draft model run by ONNX Runtime: k single-token steps from its own KV cache, brought back
    in step after a partial acceptance by a rollback and a 1-2 token extend."""

    model: OrtModel

    def __init__(self, model: OrtModel | str | os.PathLike[str] | Manifest, **options: Any) -> None:
        """A drafter over an ONNX Runtime draft model.

        Args:
            model: An :class:`OrtModel`, or a folder / manifest to build one from.
            **options: :class:`OrtModel`'s options, when ``model`` is a folder or manifest.

        Raises:
            ModelLoadError: The folder cannot be loaded.
        """
        super().__init__(model if isinstance(model, OrtModel) else OrtModel(model, **options))
