"""The step loop that batches the model calls of concurrent requests (continuous batching)."""

from .executor import BatchExecutor

__all__ = ["BatchExecutor"]
