"""One exception root for everything specdec-rt raises on purpose.

Every error the library raises on purpose derives from :class:`SpecDecError`, so a service can
catch the whole family in one place. Backend failures (ONNX Runtime, the tokenizer) are mapped to
these types at the boundary with ``raise ... from exc``; the original stays in ``__cause__``.

Families::

    SpecDecError
    ├── InvalidInputError (also ValueError)   bad arguments: sampling rows, ids, parameters, prompts
    │   └── ContextLengthError                prompt + max_new_tokens do not fit the KV cache
    ├── ModelLoadError                        missing files, a manifest that does not match its model
    │   └── ModelNotBuiltError                a recipe name whose artifacts are not built yet
    ├── InferenceError                        a model call failed in the middle of a request
    ├── ConsumerTimeoutError                  a request's consumer took no event for consumer_timeout s
    └── EngineClosedError                     a call on a closed engine
"""

from __future__ import annotations

__all__ = [
    "SpecDecError",
    "InvalidInputError",
    "ContextLengthError",
    "ModelLoadError",
    "ModelNotBuiltError",
    "InferenceError",
    "ConsumerTimeoutError",
    "EngineClosedError",
]


class SpecDecError(Exception):
    """Root of every error specdec-rt raises on purpose."""


class InvalidInputError(SpecDecError, ValueError):
    """An argument is invalid; the message names the value. Nothing was changed."""


class ContextLengthError(InvalidInputError):
    """The prompt (plus the requested new tokens) does not fit the model's KV cache.

    Attributes:
        prompt_tokens: The prompt's tokens, when known.
        max_length: The model's longest sequence, when known: the room left is the difference.
    """

    def __init__(self, message: str, prompt_tokens: int | None = None, max_length: int | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_length = prompt_tokens, max_length


class ModelLoadError(SpecDecError):
    """A model folder cannot be loaded: a missing file or a manifest that does not match."""


class ModelNotBuiltError(ModelLoadError):
    """A recipe name was given but its artifacts are not built; the message names the command."""


class InferenceError(SpecDecError):
    """A backend call failed in the middle of a request. The request is over; the engine is not."""


class ConsumerTimeoutError(SpecDecError):
    """A request ended because its consumer took none of its waiting events for ``timeout``
    seconds (the engine's ``consumer_timeout``): a stream kept but no longer read. Its KV slot
    was freed when it ended; the engine is fine.

    Attributes:
        timeout: The seconds the consumer had, when known.
    """

    def __init__(self, message: str, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class EngineClosedError(SpecDecError):
    """The engine (or scheduler) was closed and cannot serve requests."""
