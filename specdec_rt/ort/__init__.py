"""ONNX Runtime backends: models from ``python -m export`` folders behind the scheduler's Protocols."""

from __future__ import annotations

import os
from typing import Any

from ..speculation.adapters import ModelDrafter, ModelVerifier
from .concat_kv import ConcatKVModel, ConcatKVSession
from .manifest import Manifest, load_manifest, resolve_model_dir
from .model import KVPool, OrtModel, OrtSession, default_threads, use_global_thread_pool

__all__ = [
    "OrtTargetVerifier",
    "OrtDraftInferrer",
    "OrtModel",
    "ConcatKVModel",
    "ConcatKVSession",
    "RuntimeModel",
    "open_model",
    "OrtSession",
    "KVPool",
    "Manifest",
    "load_manifest",
    "resolve_model_dir",
    "default_threads",
    "use_global_thread_pool",
]


#: a model of an export folder: its own graph builder's (OrtModel) or optimum's (ConcatKVModel)
RuntimeModel = OrtModel | ConcatKVModel


def open_model(folder: str | os.PathLike[str] | Manifest, **options: Any) -> RuntimeModel:
    """The model of an export folder (or its loaded manifest), by what built its graph (the
    manifest's ``builder``): an :class:`OrtModel`, or a :class:`ConcatKVModel` for a graph built
    through optimum. ``options``: :class:`OrtModel`'s.

    Raises:
        ModelLoadError: The folder cannot be loaded.
    """
    m = folder if isinstance(folder, Manifest) else load_manifest(folder)
    if m.builder == "optimum":
        return ConcatKVModel(m, **options)
    return OrtModel(m, **options)


class OrtTargetVerifier(ModelVerifier):
    """The target: verifies k drafts in one ONNX Runtime call (k+1 logits rows)."""

    model: RuntimeModel

    def __init__(
        self, model: RuntimeModel | str | os.PathLike[str] | Manifest, *, share_hidden: bool = False, **options: Any
    ) -> None:
        """A verifier over an ONNX Runtime target.

        Args:
            model: An :class:`OrtModel` or :class:`ConcatKVModel`, or a folder / manifest to
                build one from (:func:`open_model`).
            share_hidden: Keep the target's hidden states for an EAGLE drafter (see
                ``ModelVerifier``).
            **options: :class:`OrtModel`'s options, when ``model`` is a folder or manifest.

        Raises:
            ModelLoadError: The folder cannot be loaded.
            InvalidInputError: ``share_hidden`` with a model that returns no hidden states.
        """
        super().__init__(
            model if isinstance(model, (OrtModel, ConcatKVModel)) else open_model(model, **options),
            share_hidden=share_hidden,
        )


class OrtDraftInferrer(ModelDrafter):
    """A draft model run by ONNX Runtime: k single-token steps from its own KV cache, brought back
    in step after a partial acceptance by a rollback and a 1-2 token extend."""

    model: RuntimeModel

    def __init__(self, model: RuntimeModel | str | os.PathLike[str] | Manifest, **options: Any) -> None:
        """A drafter over an ONNX Runtime draft model.

        Args:
            model: An :class:`OrtModel` or :class:`ConcatKVModel`, or a folder / manifest to
                build one from (:func:`open_model`).
            **options: :class:`OrtModel`'s options, when ``model`` is a folder or manifest.

        Raises:
            ModelLoadError: The folder cannot be loaded.
        """
        super().__init__(model if isinstance(model, (OrtModel, ConcatKVModel)) else open_model(model, **options))
