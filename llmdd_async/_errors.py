"""Every exception of the package, and the one place that maps low-level failures to status
codes (DESIGN §3).

Each class says who is at fault (trio's *Closed* vs *Broken*) and carries an
:class:`LLMStatusCode`; every one is an :class:`LLMException`:

=======================  ======================  =========================================
class                    default status          at fault
=======================  ======================  =========================================
``LLMException``         given by the raiser     (upstream's class; the caller's argument,
                                                 the state of the endpoint, ...)
``TransferCancelled``    LLM_FAILED              this side: the task's owner cancelled it
``SynchronizerAborted``  LLM_FAILED              the application: its layer synchronizer
                                                 said no, raised or timed out
``LinkClosed``           LLM_NOT_YET_LINK        this side: it unlinked or finalized
``LinkBroken``           LLM_LINK_FAILED         the peer or the network (also
                                                 LLM_NOT_YET_LINK: the peer unlinked)
``HandshakeFailed``      LLM_LINK_FAILED         the peer refused, or the settings of the two
                                                 sides differ (the code link_clusters reports)
``ControlError``         LLM_LINK_FAILED         the peer or the network: vLLM's side
                                                 channel failed
``ChildError``           the child's code, else  the child process (``llmdd_async.testing``)
                         LLM_FAILED
``ProtocolError``        LLM_FAILED              the peer: it sent bytes that are not a frame
``CopyCancelled``        LLM_FAILED              this side: a copy's token tripped
``FenceLost``            LLM_LINK_FAILED         the transport: posted transfers outlived the
                                                 stall timeout
=======================  ======================  =========================================

The last three are :class:`LowLevelError`\\ s: raised below the API and translated on the way
up (a link's failure, a task's error, a grant's status), never passed through as they are
(:func:`is_caller_facing`). :class:`map_link_errors` is the seam that turns what a link's
socket raises into the link's failure and the error its caller sees.

Importable without anyio: the sans-IO framer (``_protocol``) raises ``ProtocolError``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn, TypeGuard

from ._enums import LLMStatusCode

__all__ = [
    "LINK_IO_ERRORS",
    "ChildError",
    "ControlError",
    "CopyCancelled",
    "FenceLost",
    "HandshakeFailed",
    "LLMException",
    "LinkBroken",
    "LinkClosed",
    "LowLevelError",
    "ProtocolError",
    "Status",
    "SynchronizerAborted",
    "TransferCancelled",
    "failure_reason",
    "is_caller_facing",
    "link_failure",
    "map_link_errors",
    "raise_if_false",
    "raise_param",
    "status_from_exception",
]


class LLMException(RuntimeError):
    """An operation failed with an :class:`LLMStatusCode` (upstream's exception class)."""

    #: the code of an instance raised without one
    default_status = LLMStatusCode.LLM_SUCCESS

    def __init__(self, *args: object, status_code: LLMStatusCode | None = None) -> None:
        super().__init__(*args)
        self._status_code = self.default_status if status_code is None else status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The code that describes the failure."""
        return self._status_code

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the status code (and a subclass's attributes) when the exception crosses
        # threads or processes by copy.
        state = {k: v for k, v in self.__dict__.items() if k != "_status_code"}
        return (_rebuild, (type(self), self.args, int(self._status_code)), state)


def _rebuild(cls: type[LLMException], args: tuple[object, ...], code: int) -> LLMException:
    return cls(*args, status_code=LLMStatusCode(code))


class TransferCancelled(LLMException):
    """The task was cancelled by its owner and is fenced: no buffer of it is touched any more."""

    default_status = LLMStatusCode.LLM_FAILED

    def __init__(self, *args: object, status_code: LLMStatusCode | None = None) -> None:
        super().__init__(*(args or ("transfer cancelled",)), status_code=status_code)


class SynchronizerAborted(LLMException):
    """The application's layer synchronizer said no (False: LLM_PARAM_INVALID, as upstream),
    raised (its code) or timed out (LLM_TIMEOUT) for a layer."""

    default_status = LLMStatusCode.LLM_FAILED


class LinkClosed(LLMException):
    """This side closed the link (unlink_clusters, finalize): work on it fails with
    LLM_NOT_YET_LINK."""

    default_status = LLMStatusCode.LLM_NOT_YET_LINK


class LinkBroken(LLMException):
    """The peer or the network broke the link (peer died, reset, protocol error; the peer
    unlinked or finalized: LLM_NOT_YET_LINK); in-flight transfers fail with it."""

    default_status = LLMStatusCode.LLM_LINK_FAILED


class HandshakeFailed(LLMException):
    """The link could not be set up; ``status_code`` is what link_clusters reports.
    ``yielded``: the peer refused because its own simultaneous link to us wins (it is on its
    way)."""

    default_status = LLMStatusCode.LLM_LINK_FAILED

    def __init__(
        self, *args: object, status_code: LLMStatusCode | None = None, yielded: bool = False
    ) -> None:
        super().__init__(*args, status_code=status_code)
        self.yielded = yielded


class ControlError(LLMException):
    """vLLM's side channel failed (refused, closed, bad frame, authentication)."""

    default_status = LLMStatusCode.LLM_LINK_FAILED


class ChildError(LLMException):
    """A command failed in a child process. ``kind``: the name of the child's exception class
    (``"LLMException"``: ``status_code`` is the child's; ``"EOF"``: the child exited)."""

    default_status = LLMStatusCode.LLM_FAILED

    def __init__(
        self, *args: object, status_code: LLMStatusCode | None = None, kind: str = ""
    ) -> None:
        super().__init__(*args, status_code=status_code)
        self.kind = kind

    @property
    def code(self) -> LLMStatusCode | None:
        """The child's status code when it raised an ``LLMException``, else None."""
        return self.status_code if self.kind == "LLMException" else None


class LowLevelError(LLMException):
    """A failure below the API that the layer above translates (into a link's failure, a
    task's error, a grant's status): a site that passes a caller's LLMExceptions through as
    they are passes these only translated (:func:`is_caller_facing`)."""

    default_status = LLMStatusCode.LLM_FAILED


class ProtocolError(LowLevelError):
    """The peer sent bytes that are not a valid frame (or a frame that means nothing here).
    The connection must be closed."""


class CopyCancelled(LowLevelError):
    """A worker stopped between chunks because its token was cancelled (this side)."""


class FenceLost(LowLevelError, OSError):
    """Posted NIXL transfers did not finish within the stall timeout after a cancel or a
    failure: bytes may still land, so the link is failed (its UCX endpoints are dropped).
    Also an ``OSError``: the transport's failure."""

    default_status = LLMStatusCode.LLM_LINK_FAILED


def is_caller_facing(exc: BaseException | None) -> TypeGuard[LLMException]:
    """Whether ``exc`` already says what a caller should see: an LLMException that is not a
    :class:`LowLevelError`."""
    return isinstance(exc, LLMException) and not isinstance(exc, LowLevelError)


# ---------------------------------------------------------------------------- the link seam
#: what a link's socket I/O raises when the peer or the network failed it (TimeoutError,
#: the stall timeout, is an OSError)
LINK_IO_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError)


def failure_reason(exc: BaseException) -> str:
    """Why a link broke, in words a user can act on."""
    if isinstance(exc, EOFError):
        return "peer closed the connection"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    if isinstance(exc, ProtocolError):
        return f"protocol error: {exc}"
    return str(exc) or repr(exc)


def link_failure(exc: BaseException, peer_cluster_id: int) -> tuple[LLMException, str]:
    """What a link that ``exc`` broke fails its work with, and the reason it logs: a
    caller-facing LLMException as it is, anything else as :class:`LinkBroken`
    (LLM_LINK_FAILED) with :func:`failure_reason`."""
    if is_caller_facing(exc):
        return exc, str(exc)
    reason = failure_reason(exc)
    return LinkBroken(f"link to cluster {peer_cluster_id} is down: {reason}"), reason


class map_link_errors:  # a class, used as a statement: ``with map_link_errors(...):``
    """The seam between a link's socket I/O and its callers (httpcore's ``map_exceptions``).

    ``with map_link_errors(link.fail, "send to cluster 2 failed"):`` runs its body; an
    exception of ``catch`` (:data:`LINK_IO_ERRORS` by default) leaving it is handed to
    ``fail`` (which breaks the link: :func:`link_failure`), then

    - with ``raise_as``: raised as ``LinkBroken(f"{raise_as}: {exc}")`` (LLM_LINK_FAILED),
      chained to it, for a caller that awaits the I/O;
    - without: swallowed, for a background writer or reader whose work the broken link
      fails.

    Anything else passes through untouched. One instance may be reused: it keeps no state.

    Raises:
        LinkBroken: with ``raise_as``, for an exception of ``catch``.
    """

    __slots__ = ("_catch", "_fail", "_raise_as")

    def __init__(
        self,
        fail: Callable[[BaseException], object],
        raise_as: str | None = None,
        catch: tuple[type[BaseException], ...] = LINK_IO_ERRORS,
    ) -> None:
        self._fail = fail
        self._raise_as = raise_as
        self._catch = catch

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or not isinstance(exc, self._catch):
            return False
        self._fail(exc)
        if self._raise_as is None:
            return True
        raise LinkBroken(f"{self._raise_as}: {exc}") from exc


# ---------------------------------------------------------------------------- status codes
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
    if isinstance(exc, TimeoutError):
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
