"""JSON-lines command processes: the child serves commands, the parent drives it.

Used by the test kit (:class:`llmdd_async.testing.PeerProcess`) and the demo's workers. One
JSON object per line each way; replies carry the request id, ``ok``, and a result or an error
(with the LLMStatusCode for LLMExceptions). The child's event loop comes from the environment
variable ``LLMDD_PEER_LOOP`` (``asyncio``, ``uvloop`` or ``trio``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from ._enums import LLMStatusCode
from ._errors import ChildError, is_caller_facing

__all__ = ["ChildProcess", "CommandServer", "run_server"]


class CommandServer:
    """Child side: each ``{"id", "op", "args"}`` line runs ``await self.<op>(**args)``."""

    tg: anyio.abc.TaskGroup
    #: set by the ``exit`` command; endpoints started by :meth:`start_endpoint` then stop
    stop: anyio.Event
    #: where replies go: the process's original stdout, which nothing else writes to
    replies: Any = sys.stdout

    async def start_endpoint(self, datadist: Any, options: dict[str, str]) -> None:
        """Run ``datadist`` in the background until ``exit``; return once it is up.

        Raises:
            Exception: whatever starting it raised.
        """
        started = anyio.Event()
        error: list[BaseException] = []

        async def run() -> None:
            try:
                async with datadist.running(options):
                    started.set()
                    await self.stop.wait()
            except Exception as exc:
                error.append(exc)
                started.set()

        self.tg.start_soon(run)
        await started.wait()
        if error:
            raise error[0]

    async def exit(self) -> None:
        self.stop.set()

    async def serve(self) -> None:
        stdin = anyio.wrap_file(sys.stdin)
        async with anyio.create_task_group() as tg:
            self.tg = tg
            async for line in stdin:
                if not line.strip():
                    continue
                req = json.loads(line)
                tg.start_soon(self._one, req)
                if req["op"] == "exit":
                    break

    async def _one(self, req: dict[str, Any]) -> None:
        reply: dict[str, Any]
        try:
            result = await getattr(self, req["op"])(**req.get("args", {}))
            reply = {"id": req["id"], "ok": True, "result": result}
        except Exception as exc:
            if is_caller_facing(exc):
                reply = {
                    "id": req["id"],
                    "ok": False,
                    "error": str(exc),
                    "type": "LLMException",
                    "code": int(exc.status_code),
                }
            else:  # below the API (a protocol error, a stopped copy): named as it is
                reply = {
                    "id": req["id"],
                    "ok": False,
                    "error": repr(exc),
                    "type": type(exc).__name__,
                }
        self.replies.write(json.dumps(reply) + "\n")
        self.replies.flush()


T = TypeVar("T")

#: starts ``python -m module`` with an environment (and stderr inherited or not) some faster
#: way, or returns None where it cannot
Launcher = Callable[[str, dict[str, str], bool], Awaitable["anyio.abc.Process | None"]]

#: the longest reply line (base64 tensors of test caches)
_MAX_REPLY = 1 << 30


def run_on_loop(loop: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run`` on the loop named ``asyncio``, ``uvloop`` or ``trio``."""
    if loop == "trio":
        return anyio.run(fn, *args, backend="trio")
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


def run_server(server: CommandServer) -> None:
    """Serve commands on the event loop named by ``LLMDD_PEER_LOOP``.

    Replies keep the original stdout to themselves: file descriptor 1 becomes stderr first,
    since native libraries (UCX logs to stdout) write to it and would corrupt the JSON lines.
    """
    sys.stdout.flush()
    server.replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    run_on_loop(os.environ.get("LLMDD_PEER_LOOP", "asyncio"), server.serve)


class ChildProcess:
    """Parent side of one command process."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        # Signals go through a pidfd: never to another process that took the pid of this one
        # once reaped, and without polling it (a poll may reap it under asyncio's watcher).
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):
            own = getattr(process, "pidfd", None)  # (a fork server's child has one)
            self._pidfd = os.pidfd_open(process.pid) if own is None else os.dup(own)
        self._ids = itertools.count(1)
        self._waiters: dict[int, anyio.Event] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self._lock = anyio.Lock()

    @classmethod
    @contextlib.asynccontextmanager
    async def spawn(
        cls,
        module: str,
        loop: str = "asyncio",
        env: dict[str, str] | None = None,
        inherit_stderr: bool = False,
        prefix: Sequence[str] = (),
        launch: Launcher | None = None,
    ) -> AsyncIterator[Any]:
        """Start ``python -m module``; on exit ask it to stop, and kill it if it does not.

        ``inherit_stderr``: the child writes to this process's stderr (its log lines, say)
        instead of a pipe. ``prefix``: a command line the interpreter runs under (``ip netns
        exec NAME``, say); it must exec the interpreter in place, so that :meth:`pause` and
        :meth:`kill` reach the child itself. ``launch``: starts the child some other way
        (``launch(module, env, inherit_stderr)``, a fork server's, say) or returns None, and
        then it is started as above; not with a prefix."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", LLMDD_PEER_LOOP=loop, **(env or {}))
        process: anyio.abc.Process | None = None
        if launch is not None and not prefix:
            process = await launch(module, full_env, inherit_stderr)
        if process is None:
            process = await anyio.open_process(
                [*prefix, sys.executable, "-m", module],
                env=full_env,
                stderr=None if inherit_stderr else subprocess.PIPE,
            )
        child = cls(process)
        body_error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(child._read_replies)
            try:
                yield child
            except BaseException as exc:
                body_error = exc  # re-raised as itself, not inside an ExceptionGroup
            finally:
                with anyio.CancelScope(shield=True):
                    await child.close()
                tg.cancel_scope.cancel()
        if body_error is not None:
            raise body_error

    async def _read_replies(self) -> None:
        assert self.process.stdout is not None
        lines = BufferedByteReceiveStream(self.process.stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", _MAX_REPLY)
            except (anyio.IncompleteRead, anyio.ClosedResourceError, anyio.BrokenResourceError):
                # The child is gone; or close() closed its pipe before this read saw the end
                # (a loaded machine: the reader had not run since the child exited).
                break
            reply = json.loads(line)
            self._results[reply["id"]] = reply
            ev = self._waiters.pop(reply["id"], None)
            if ev is not None:
                ev.set()
        for ev in self._waiters.values():
            ev.set()

    async def request(self, op: str, **args: Any) -> Any:
        """Run one command in the child and return its result.

        Raises:
            ChildError: the command failed there, or the child is gone.
        """
        rid = next(self._ids)
        ev = anyio.Event()
        self._waiters[rid] = ev
        try:
            await self._send(rid, op, args)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            # The child exited before this command reached it: the same as dying under it.
            self._waiters.pop(rid, None)
            raise ChildError("the child process exited", kind="EOF") from None
        await ev.wait()
        reply = self._results.pop(rid, None)
        if reply is None:
            raise ChildError("the child process exited", kind="EOF")
        if not reply["ok"]:
            code = reply.get("code")
            raise ChildError(
                reply["error"],
                kind=reply["type"],
                status_code=None if code is None else LLMStatusCode.from_wire(code),
            )
        return reply["result"]

    async def _send(self, rid: int, op: str, args: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        line = (json.dumps({"id": rid, "op": op, "args": args}) + "\n").encode()
        async with self._lock:
            await self.process.stdin.send(line)

    def pause(self) -> None:
        """SIGSTOP the child: a peer that hangs without closing its sockets."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child: a peer that dies mid-transfer."""
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is None:
                os.kill(self.process.pid, sig)
            else:
                signal.pidfd_send_signal(self._pidfd, sig)

    async def close(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(Exception), anyio.move_on_after(5):
                self.resume()
                # Its exit answers, not its reply: the reader may be cancelled already (the
                # block that ran the child was).
                await self._send(next(self._ids), "exit", {})
                await self.process.wait()
            self.kill()
        with contextlib.suppress(Exception):
            await self.process.wait()
        await self.process.aclose()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
