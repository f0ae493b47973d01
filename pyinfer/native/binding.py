"""The compiled cffi module, and the one place C status codes become Python exceptions."""

from __future__ import annotations

from pyinfer.errors import AllocationError, BackendError, InvalidArgumentError, PyInferError, UnsupportedError

try:
    from pyinfer._pyinfer_native import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        f"pyinfer's native engine is missing or broken ({exc}): rebuild it with `pip install -e .`"
    ) from exc

_ERRORS = {
    lib.GGML_STATUS_INVALID_ARG: InvalidArgumentError,
    lib.GGML_STATUS_ALLOC_FAILED: AllocationError,
    lib.GGML_STATUS_UNSUPPORTED: UnsupportedError,
    lib.GGML_STATUS_BACKEND_ERROR: BackendError,
}


def last_error() -> PyInferError:
    """The exception for the C side's last failure on this thread."""
    status = lib.ggml_last_status()
    message = ffi.string(lib.ggml_last_error()).decode(errors="replace") or "native call failed"
    return _ERRORS.get(status, PyInferError)(message)


def check(status: int) -> None:
    """Raises the matching PyInferError when a C call returned a failing status."""
    if status != lib.GGML_STATUS_OK:
        raise last_error()


def check_ptr(ptr):
    """Returns ptr, or raises the C side's error when it is NULL."""
    if ptr == ffi.NULL:
        raise last_error()
    return ptr
