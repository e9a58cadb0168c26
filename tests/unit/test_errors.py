"""Errors in one room: every exception class lives in ``_errors``, is an LLMException with a
status code, and low-level failures map to the documented codes, through one seam."""

from __future__ import annotations

import ast
import builtins
import errno
import inspect
import pathlib
import pickle

import anyio
import anyio.lowlevel
import pytest

import llmdd_async as dd
from llmdd_async import _errors
from llmdd_async._enums import LLMStatusCode as S
from llmdd_async._errors import (
    LINK_IO_ERRORS,
    ChildError,
    ControlError,
    CopyCancelled,
    FenceLost,
    HandshakeFailed,
    LinkBroken,
    LinkClosed,
    LLMException,
    LowLevelError,
    ProtocolError,
    SynchronizerAborted,
    TransferCancelled,
    failure_reason,
    is_caller_facing,
    link_failure,
    map_link_errors,
    status_from_exception,
)

PACKAGE = pathlib.Path(dd.__file__).parent

#: every class of the room, the code it carries when raised without one, and who is at fault
HIERARCHY: list[tuple[type[LLMException], S]] = [
    (TransferCancelled, S.LLM_FAILED),  # this side: the owner cancelled
    (SynchronizerAborted, S.LLM_FAILED),  # the application's synchronizer
    (LinkClosed, S.LLM_NOT_YET_LINK),  # this side unlinked or finalized
    (LinkBroken, S.LLM_LINK_FAILED),  # the peer or the network
    (HandshakeFailed, S.LLM_LINK_FAILED),  # the peer refused, settings differ
    (ControlError, S.LLM_LINK_FAILED),  # vLLM's side channel: the peer or the network
    (ChildError, S.LLM_FAILED),  # the child process
    (ProtocolError, S.LLM_FAILED),  # the peer sent garbage
    (CopyCancelled, S.LLM_FAILED),  # this side's token tripped
    (FenceLost, S.LLM_LINK_FAILED),  # the transport did not fence
]


def _exception_classes() -> set[type[BaseException]]:
    return {
        obj
        for _, obj in inspect.getmembers(_errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == _errors.__name__
    }


# ------------------------------------------------------------------------------ hierarchy
def test_the_table_lists_every_class_of_the_room() -> None:
    assert _exception_classes() == {cls for cls, _ in HIERARCHY} | {LLMException, LowLevelError}


@pytest.mark.parametrize(("cls", "code"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
def test_each_class_is_an_llm_exception_with_its_status(cls: type[LLMException], code: S) -> None:
    exc = cls("why")
    assert isinstance(exc, LLMException)
    assert isinstance(exc, RuntimeError)  # upstream's LLMException is one
    assert exc.status_code == code
    assert status_from_exception(exc) == code
    assert cls("why", status_code=S.LLM_TIMEOUT).status_code == S.LLM_TIMEOUT


@pytest.mark.parametrize(("cls", "code"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
def test_a_copy_keeps_class_message_code_and_attributes(cls: type[LLMException], code: S) -> None:
    exc = cls("why", status_code=S.LLM_TIMEOUT)
    exc.__dict__.update({"yielded": True} if cls is HandshakeFailed else {})
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc)
    assert back.status_code == S.LLM_TIMEOUT
    assert back.__dict__ == exc.__dict__


def test_plain_llm_exception_keeps_upstreams_default() -> None:
    assert LLMException("x").status_code == S.LLM_SUCCESS
    assert TransferCancelled().args == ("transfer cancelled",)


def test_subclass_attributes() -> None:
    assert HandshakeFailed("no", status_code=S.LLM_ALREADY_LINK, yielded=True).yielded is True
    assert HandshakeFailed("no").yielded is False
    child = ChildError("gone", kind="EOF")
    assert (child.kind, child.status_code) == ("EOF", S.LLM_FAILED)


def test_fence_lost_is_also_the_transports_os_error() -> None:
    exc = FenceLost("still in flight")
    assert isinstance(exc, OSError)
    assert exc.errno is None
    assert str(exc) == "still in flight"


def test_low_level_errors_are_translated_not_passed_through() -> None:
    for exc in (ProtocolError("bad"), CopyCancelled(), FenceLost("late")):
        assert isinstance(exc, LowLevelError)
        assert not is_caller_facing(exc)
    for exc in (LLMException("x"), LinkBroken("y"), LinkClosed("z"), TransferCancelled()):
        assert is_caller_facing(exc)
    assert not is_caller_facing(OSError("no"))
    assert not is_caller_facing(None)


def test_synchronizer_aborted_is_public() -> None:
    assert dd.SynchronizerAborted is SynchronizerAborted
    assert "SynchronizerAborted" in dd.__all__
    assert issubclass(dd.TransferCancelled, dd.LLMException)


# ------------------------------------------------------------------------------ one room
def _bases(node: ast.ClassDef) -> set[str]:
    names = set()
    for b in node.bases:
        if isinstance(b, ast.Name):
            names.add(b.id)
        elif isinstance(b, ast.Attribute):
            names.add(b.attr)
    return names


def test_no_exception_class_outside_the_room() -> None:
    exception_names = {
        name
        for name, obj in vars(builtins).items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    } | {cls.__name__ for cls in _exception_classes()}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _bases(node) & exception_names:
                found.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert found == []


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("llmdd_async._protocol", "ProtocolError"),
        ("llmdd_async._memory", "CopyCancelled"),
        ("llmdd_async._net.link", "LinkBroken"),
        ("llmdd_async._net.handshake", "HandshakeFailed"),
        ("llmdd_async._childproc", "ChildError"),
    ],
)
def test_old_rooms_do_not_export_the_names(module: str, name: str) -> None:
    mod = __import__(module, fromlist=["__all__"])
    assert name not in getattr(mod, "__all__", ())


def test_the_room_needs_no_event_loop_library() -> None:
    # The sans-IO framer raises ProtocolError: _errors imports only the stdlib and _enums.
    tree = ast.parse((PACKAGE / "_errors.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported <= {
        "__future__",
        "errno",
        "socket",
        "collections.abc",
        "types",
        "typing",
        "._enums",
    }
    enums = ast.parse((PACKAGE / "_enums.py").read_text())
    assert not any(
        isinstance(n, ast.Import | ast.ImportFrom) and "anyio" in ast.unparse(n)
        for n in ast.walk(enums)
    )


# ------------------------------------------------------------------------------ status codes
@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (OSError("refused"), S.LLM_LINK_FAILED),
        (ConnectionResetError(), S.LLM_LINK_FAILED),
        (BrokenPipeError(), S.LLM_LINK_FAILED),
        (EOFError(), S.LLM_LINK_FAILED),
        (TimeoutError(), S.LLM_TIMEOUT),
        (OSError(errno.ETIMEDOUT, "timed out"), S.LLM_TIMEOUT),
        (OSError(errno.EAGAIN, "again"), S.LLM_TIMEOUT),
        (OSError(errno.ENOMEM, "no memory"), S.LLM_OUT_OF_MEMORY),
        (MemoryError(), S.LLM_OUT_OF_MEMORY),
        (ValueError(), S.LLM_PARAM_INVALID),
        (TypeError(), S.LLM_PARAM_INVALID),
        (KeyError("k"), S.LLM_FAILED),
        (ProtocolError("bad frame"), S.LLM_FAILED),
        (CopyCancelled(), S.LLM_FAILED),
        (FenceLost("late"), S.LLM_LINK_FAILED),
        (LinkBroken("gone", status_code=S.LLM_NOT_YET_LINK), S.LLM_NOT_YET_LINK),
    ],
    ids=repr,
)
def test_each_low_level_error_maps_to_its_status(exc: BaseException, code: S) -> None:
    assert status_from_exception(exc) == code


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (EOFError("x"), "peer closed the connection"),
        (ConnectionResetError("x"), "connection reset by peer"),
        (ProtocolError("bad magic"), "protocol error: bad magic"),
        (TimeoutError("the peer stopped reading"), "the peer stopped reading"),
        (OSError(), "OSError()"),
        (CopyCancelled(), "CopyCancelled()"),
        (FenceLost("late"), "late"),
    ],
    ids=repr,
)
def test_a_low_level_failure_breaks_the_link_as_link_broken(
    exc: BaseException, reason: str
) -> None:
    assert failure_reason(exc) == reason
    broken, why = link_failure(exc, 7)
    assert type(broken) is LinkBroken
    assert broken.status_code == S.LLM_LINK_FAILED
    assert str(broken) == f"link to cluster 7 is down: {reason}"
    assert why == reason


@pytest.mark.parametrize(
    "exc",
    [
        LinkBroken("cluster 7 finalized", status_code=S.LLM_NOT_YET_LINK),
        LLMException("payload failed authentication", status_code=S.LLM_LINK_FAILED),
        LinkBroken("cluster 7 broke the link: because"),
    ],
    ids=repr,
)
def test_a_caller_facing_error_breaks_the_link_as_it_is(exc: LLMException) -> None:
    assert link_failure(exc, 7) == (exc, str(exc))


# ------------------------------------------------------------------------------ the seam
class _Link:
    def __init__(self) -> None:
        self.failures: list[BaseException] = []

    def fail(self, exc: BaseException) -> None:
        self.failures.append(exc)


@pytest.mark.parametrize(
    "exc",
    [OSError("reset"), ConnectionResetError(), TimeoutError("stall"), EOFError("closed")],
    ids=repr,
)
def test_the_seam_fails_the_link_and_raises_what_the_caller_sees(exc: BaseException) -> None:
    link = _Link()
    with pytest.raises(LinkBroken) as info, map_link_errors(link.fail, "send to cluster 3 failed"):
        raise exc
    assert link.failures == [exc]
    assert str(info.value) == f"send to cluster 3 failed: {exc}"
    assert info.value.status_code == S.LLM_LINK_FAILED
    assert info.value.__cause__ is exc


def test_the_seam_without_raise_as_swallows_once_the_link_failed() -> None:
    link = _Link()
    exc = TimeoutError("the peer made no progress")
    after = []
    with map_link_errors(link.fail):
        raise exc
    after.append("went on")
    assert link.failures == [exc]
    assert after == ["went on"]


@pytest.mark.parametrize(
    "exc", [ProtocolError("encode"), LLMException("x"), ValueError("bug"), KeyboardInterrupt()]
)
def test_the_seam_lets_everything_else_through_untouched(exc: BaseException) -> None:
    link = _Link()
    with pytest.raises(type(exc)) as info, map_link_errors(link.fail, "send"):
        raise exc
    assert info.value is exc
    assert link.failures == []


def test_the_seam_catches_what_it_is_told_and_is_reusable() -> None:
    link = _Link()
    seam = map_link_errors(link.fail, catch=(*LINK_IO_ERRORS, LLMException))
    errors = [EOFError(), ProtocolError("bad"), LinkBroken("mac")]
    for exc in errors:
        with seam:
            raise exc
    with seam:
        pass  # nothing raised: nothing failed
    assert link.failures == errors


@pytest.mark.anyio
async def test_the_seam_holds_across_awaits_and_passes_cancellation() -> None:
    link = _Link()
    with pytest.raises(LinkBroken), map_link_errors(link.fail, "sending to cluster 1"):
        await anyio.lowlevel.checkpoint()
        raise BrokenPipeError("gone")
    assert len(link.failures) == 1
    with anyio.CancelScope() as scope:
        scope.cancel()
        with map_link_errors(link.fail, "sending to cluster 1"):
            await anyio.sleep(1)
    assert scope.cancelled_caught
    assert len(link.failures) == 1  # a cancellation is no link failure


def test_a_peers_status_code_maps_to_ours_and_anything_else_to_failed() -> None:
    """``LLMStatusCode.from_wire`` (every GRANT, DONE, RESULT and ABORT a peer sends): a
    known code is ours, whatever int type carries it; anything else is LLM_FAILED."""
    import numpy as np

    for code in S:
        assert S.from_wire(int(code)) is code
        assert S.from_wire(np.int64(int(code))) is code
    assert S.from_wire(S.LLM_TIMEOUT) is S.LLM_TIMEOUT
    for bad in (123456789, -2, 2**70, "0", None, [0], 1.5):
        assert S.from_wire(bad) is S.LLM_FAILED  # type: ignore[arg-type]
