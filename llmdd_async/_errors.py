"""Exceptions, and the one place that maps low-level failures to status codes (DESIGN §3)."""

from __future__ import annotations

import errno
import socket
from typing import NoReturn

from ._enums import LLMStatusCode

__all__ = [
    "LLMException",
    "Status",
    "TransferCancelled",
    "raise_if_false",
    "raise_param",
    "status_from_exception",
]


class LLMException(RuntimeError):
    """An operation failed with an :class:`LLMStatusCode` (upstream's exception class)."""

    def __init__(self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS):
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The code that describes the failure."""
        return self._status_code

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the status code when the exception crosses threads or processes by copy.
        return (_rebuild, (type(self), self.args, int(self._status_code)))


def _rebuild(cls: type[LLMException], args: tuple[object, ...], code: int) -> LLMException:
    return cls(*args, status_code=LLMStatusCode(code))


class TransferCancelled(LLMException):
    """The task was cancelled by its owner and is fenced: no buffer of it is touched any more."""

    def __init__(self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED):
        super().__init__(*(args or ("transfer cancelled",)), status_code=status_code)


class Status:
    """Upstream's ``Status`` wrapper of a code."""

    def __init__(self, status_code: LLMStatusCode) -> None:
        self._status_code = LLMStatusCode(status_code)

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


def raise_param(message: str) -> NoReturn:
    """Raise ``LLMException(LLM_PARAM_INVALID)`` with ``message``."""
    raise LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def raise_if_false(
    condition: object, message: str, code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID
) -> None:
    """Semantic check: raise ``LLMException(code)`` unless ``condition`` holds."""
    if not condition:
        raise LLMException(message, status_code=code)


def failed(func: str, code: LLMStatusCode, info: str) -> LLMException:
    """Build an exception with upstream's message shape."""
    return LLMException(f"[{func}] failed, error code is {code}, {info}.", status_code=code)


_TIMEOUT_ERRNOS = {errno.ETIMEDOUT, errno.EAGAIN, errno.EWOULDBLOCK}


def status_from_exception(exc: BaseException) -> LLMStatusCode:
    """Map any failure seen while moving data to the status code a caller should see.

    This is the only place that turns OS, socket and timeout errors into codes, so the same
    fault always reports the same code whichever transport saw it.
    """
    if isinstance(exc, LLMException):
        return exc.status_code
    if isinstance(exc, TimeoutError | socket.timeout):
        return LLMStatusCode.LLM_TIMEOUT
    if isinstance(exc, EOFError | ConnectionError | BrokenPipeError):
        return LLMStatusCode.LLM_LINK_FAILED
    if isinstance(exc, OSError):
        if exc.errno in _TIMEOUT_ERRNOS:
            return LLMStatusCode.LLM_TIMEOUT
        if exc.errno == errno.ENOMEM:
            return LLMStatusCode.LLM_OUT_OF_MEMORY
        return LLMStatusCode.LLM_LINK_FAILED
    if isinstance(exc, MemoryError):
        return LLMStatusCode.LLM_OUT_OF_MEMORY
    if isinstance(exc, TypeError | ValueError):
        return LLMStatusCode.LLM_PARAM_INVALID
    return LLMStatusCode.LLM_FAILED
