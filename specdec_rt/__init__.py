"""specdec-rt: lossless speculative decoding on ONNX Runtime for async Python services.

A small draft model proposes tokens; the target checks them all in one forward pass; rejection
sampling keeps exactly the target's output distribution (greedy: exactly the target's tokens).
"""

from .acceptance import SpecConfig
from .adapters import ModelDrafter, ModelVerifier
from .context import RequestContext
from .errors import (
    ContextLengthError,
    EngineClosedError,
    InferenceError,
    InvalidInputError,
    ModelLoadError,
    ModelNotBuiltError,
    SpecDecError,
)
from .protocols import CacheSession, DraftInferrer, LanguageModel, TargetVerifier
from .sampling import SamplingParams, rejection_sample
from .scheduler import RequestStream, SpecDecScheduler
from .types import DraftToken, GenerationResult, Stats, TokenEvent, Verdict

__version__ = "0.1.0"

__all__ = [
    "SpecDecScheduler",
    "RequestStream",
    "SpecConfig",
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
    "EngineClosedError",
]
