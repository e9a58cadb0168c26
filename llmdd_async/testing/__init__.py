"""Test kit: real peer endpoints in child processes, for testing code that uses llmdd_async.

::

    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, options) as prompt:
        cache_id = await prompt.request("alloc", kind="blocks", num_tensors=2,
                                        shape=[8, 64], blocks_key=[1, 0], seed=7)
        ip, port = prompt.listen
        ...  # link to it, pull from it; compare with pattern(7 + tensor, nbytes)

The child fills tensor ``i`` of a cache allocated with ``seed=s`` with ``pattern(s + i, n)``,
so tests can compute the expected bytes without moving them through the test harness.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import numpy as np

import llmdd_async as dd

__all__ = ["PeerError", "PeerProcess", "decode_key", "encode_key", "pattern"]


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for seed ``seed`` (what a peer writes into filled tensors)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def encode_key(key: Any) -> list[Any] | None:
    """A key as JSON: ``["CacheKey", cluster, req, model, prefix]`` and so on."""
    if key is None:
        return None
    if isinstance(key, dd.CacheKey):
        return ["CacheKey", key.cluster_id, key.req_id, key.model_id, key.prefix_id]
    if isinstance(key, dd.CacheKeyByIdAndIndex):
        return ["CacheKeyByIdAndIndex", key.cluster_id, key.cache_id, key.batch_index]
    if isinstance(key, dd.BlocksCacheKey):
        return ["BlocksCacheKey", key.cluster_id, key.model_id]
    raise TypeError(f"cannot encode {key!r}")


def decode_key(data: Any) -> Any:
    if data is None:
        return None
    kind, *args = data
    return getattr(dd, kind)(*args)


class PeerError(Exception):
    """The peer's command failed; ``code`` holds the LLMStatusCode for LLMExceptions."""

    def __init__(self, message: str, kind: str, code: int | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = None if code is None else dd.LLMStatusCode(code)


class PeerProcess:
    """A child process running one endpoint, driven by JSON commands."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.listen: tuple[str, int] | None = None
        self._ids = itertools.count(1)
        self._waiters: dict[int, Any] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self._lock = anyio.Lock()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls, role: dd.LLMRole, cluster_id: int, options: dict[str, str], loop: str = "asyncio"
    ) -> AsyncIterator[PeerProcess]:
        """Start the child (its event loop: ``asyncio``, ``uvloop`` or ``trio``), initialise
        its endpoint, and stop it on exit.

        Raises:
            PeerError: the endpoint failed to start.
        """
        env = dict(os.environ, PYTHONUNBUFFERED="1", LLMDD_PEER_LOOP=loop)
        process = await anyio.open_process(
            [sys.executable, "-m", "llmdd_async.testing._peer_main"], env=env
        )
        peer = cls(process)
        body_error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer._read_replies)
            try:
                listen = await peer.request(
                    "start", role=int(role), cluster_id=cluster_id, options=options
                )
                peer.listen = None if listen is None else (listen[0], listen[1])
                yield peer
            except BaseException as exc:
                body_error = exc  # re-raised as itself, not inside an ExceptionGroup
            finally:
                with anyio.CancelScope(shield=True):
                    await peer.close()
                tg.cancel_scope.cancel()
        if body_error is not None:
            raise body_error

    async def _read_replies(self) -> None:
        assert self.process.stdout is not None
        buf = b""
        async for chunk in self.process.stdout:
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
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
            PeerError: the command failed there, or the child is gone.
        """
        rid = next(self._ids)
        ev = anyio.Event()
        self._waiters[rid] = ev
        assert self.process.stdin is not None
        async with self._lock:
            await self.process.stdin.send(
                (json.dumps({"id": rid, "op": op, "args": args}) + "\n").encode()
            )
        await ev.wait()
        reply = self._results.pop(rid, None)
        if reply is None:
            raise PeerError("peer process exited", "EOF", None)
        if not reply["ok"]:
            raise PeerError(reply["error"], reply["type"], reply.get("code"))
        return reply["result"]

    async def call(self, method: str, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        """Call a CacheManager method in the child. Pass caches as ``{"cache": id}``, keys
        through :func:`encode_key` as ``{"key": ...}`` and ranges as ``{"range": [a, b]}``.
        Transfers are awaited there; their status code comes back (0 on success)."""
        return await self.request("call", method=method, args=list(args), kwargs=kwargs, wait=wait)

    def pause(self) -> None:
        """SIGSTOP the child: a peer that hangs without closing its sockets."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child: a peer that dies mid-transfer."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)

    async def close(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(Exception), anyio.move_on_after(5):
                self.resume()
                await self.request("exit")
                await self.process.wait()
            self.kill()
        with contextlib.suppress(Exception):
            await self.process.wait()
        await self.process.aclose()
