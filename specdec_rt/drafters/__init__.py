"""Drafters that need no model backend: n-gram lookup, and a combination of drafters.

A model draft is :class:`~specdec_rt.speculation.adapters.ModelDrafter` (any LanguageModel); the ONNX
Runtime ones (a draft model, an EAGLE head) live in :mod:`specdec_rt.ort`, and the engine's
factory (:mod:`specdec_rt.engine.factory`) turns a draft spec such as ``"ngram+q8"`` into one.
"""

from .combined import CombinedDrafter
from .ngram import NgramDrafter

__all__ = ["NgramDrafter", "CombinedDrafter"]
