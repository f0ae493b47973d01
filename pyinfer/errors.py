"""Exceptions of pyinfer: every failure a user can cause is one of these, shown as one line."""


class PyInferError(Exception):
    """Base of every error pyinfer raises on purpose."""


class InvalidArgumentError(PyInferError, ValueError):
    """Shape or type mismatch, null data, out-of-range rows or positions."""


class AllocationError(PyInferError, MemoryError):
    """Memory for tensors, KV cache or a graph could not be had."""


class UnsupportedError(PyInferError):
    """A type, op, architecture or device this build does not support."""


class BackendError(PyInferError):
    """A device failed (CUDA error, no device present)."""


class ModelFormatError(PyInferError):
    """A model file is missing, truncated, or not a valid GGUF/PowerGGUF/checkpoint."""


class ContextFullError(PyInferError):
    """The sequence would not fit in the KV cache (-c)."""
