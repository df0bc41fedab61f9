"""specdec-rt: lossless speculative decoding on ONNX Runtime for async Python services.

A small draft model proposes tokens; the target checks them all in one forward pass; rejection
sampling keeps exactly the target's output distribution (greedy: exactly the target's tokens).
"""

from .errors import (
    ConsumerTimeoutError,
    ContextLengthError,
    EngineClosedError,
    InferenceError,
    InvalidInputError,
    ModelLoadError,
    ModelNotBuiltError,
    SpecDecError,
)
from .policy.config import SpecConfig
from .request.params import RequestParams
from .sampling import SamplingParams, rejection_sample
from .speculation.adapters import ModelDrafter, ModelVerifier
from .speculation.context import RequestContext
from .speculation.protocols import CacheSession, DraftInferrer, LanguageModel, TargetVerifier
from .speculation.scheduler import RequestStream, SpecDecScheduler
from .types import DraftToken, GenerationResult, Stats, TokenEvent, Verdict

__version__ = "0.1.0"

_LAZY = {  # ONNX Runtime is imported only when these are used
    "Engine": ".engine",
    "EngineResult": ".engine",
    "StreamEvent": ".engine",
    "OrtTargetVerifier": ".ort",
    "OrtDraftInferrer": ".ort",
    "OrtModel": ".ort",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'specdec_rt' has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineResult",
    "StreamEvent",
    "OrtTargetVerifier",
    "OrtDraftInferrer",
    "OrtModel",
    "SpecDecScheduler",
    "RequestStream",
    "SpecConfig",
    "RequestParams",
    "SamplingParams",
    "rejection_sample",
    "DraftInferrer",
    "TargetVerifier",
    "LanguageModel",
    "CacheSession",
    "ModelDrafter",
    "ModelVerifier",
    "RequestContext",
    "DraftToken",
    "Verdict",
    "TokenEvent",
    "Stats",
    "GenerationResult",
    "SpecDecError",
    "InvalidInputError",
    "ContextLengthError",
    "ModelLoadError",
    "ModelNotBuiltError",
    "InferenceError",
    "ConsumerTimeoutError",
    "EngineClosedError",
]
