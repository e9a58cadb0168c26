"""Helpers of the GPU proof tests: a torch peer in its own process, options, host references.

Only public names of llmdd_async are imported (package modules may move).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch
from helpers import cm_options

from llmdd_async.testing import pattern

PEER_SCRIPT = Path(__file__).with_name("_torch_peer.py")
ROOT = Path(__file__).resolve().parents[2]
#: the child's cluster id (it listens) and ours (we initiate)
PEER, LOCAL = 1, 2
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"
#: ``@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)``: a CUDA-only test
CUDA_ONLY = [
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA), id="cuda"
    )
]
#: ``@pytest.mark.parametrize("device", CPU_ONLY, indirect=True)``: the CPU emulation of one
CPU_ONLY = [pytest.param("cpu", id="cpu")]
#: the longest a command of the child may take before the test fails (never hangs)
COMMAND_TIMEOUT_S = 120.0


class PeerCommandError(Exception):
    """A command failed in the child (``code``: its LLMStatusCode value, if any), or the
    child is gone."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def endpoint_options(device: str, transport: str, *, listen: bool = False) -> dict[str, str]:
    """Options of a torch endpoint on ``device``: cache-manager and remote-accessible mode,
    ``llm.Transport=transport``; a generous deadline (busy CI machines, slow first CUDA use)."""
    opts = cm_options(
        **{
            "llm.DeviceAdapter": "torch",
            "llm.TorchDevice": device,
            "llm.Transport": transport,
            "llm.EnableRemoteCacheAccessible": "1",
            "llm.SyncKvCacheWaitTime": "20000",
        }
    )
    if listen:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    return opts


class TorchPeer:
    """The parent side of ``_torch_peer.py``: one child process (its own torch context) that
    hosts endpoints for many tests. Requests are blocking pipe I/O, so async tests issue
    them through :meth:`request`, in a worker thread, leaving their event loop free to serve
    the transfers the child starts meanwhile."""

    def __init__(self, device: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.device = device
        self.process = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name="torch-peer")
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            reply = json.loads(line)
            with self._lock:
                fut = self._pending.pop(reply["id"], None)
            if fut is not None:
                fut.set_result(reply)
        with self._lock:  # the child is gone: nothing pending may wait forever
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(PeerCommandError(f"the {self.device} torch peer exited"))

    def call(self, op: str, **args: Any) -> Any:
        """Run one command in the child (blocking) and return its result.

        Raises:
            PeerCommandError: it failed there, the child is gone, or no reply came in
                ``COMMAND_TIMEOUT_S``.
        """
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            rid = next(self._ids)
            self._pending[rid] = fut
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(json.dumps({"id": rid, "op": op, "args": args}) + "\n")
                self.process.stdin.flush()
            except OSError as exc:
                self._pending.pop(rid, None)
                raise PeerCommandError(f"the {self.device} torch peer is gone: {exc}") from exc
        try:
            reply = fut.result(COMMAND_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise PeerCommandError(f"{op}: no reply in {COMMAND_TIMEOUT_S} s") from None
        if not reply["ok"]:
            raise PeerCommandError(f"{op}: {reply['error']}", reply.get("code"))
        return reply["result"]

    async def request(self, op: str, **args: Any) -> Any:
        """:meth:`call` in a worker thread. Raises what :meth:`call` raises."""
        return await anyio.to_thread.run_sync(functools.partial(self.call, op, **args))

    @contextlib.asynccontextmanager
    async def endpoint(
        self, transport: str, role: str = "MIX", cluster_id: int = PEER
    ) -> AsyncIterator[PeerEndpoint]:
        """A running endpoint in the child (listening on 127.0.0.1), stopped on exit.

        Raises:
            PeerCommandError: it failed to start.
        """
        opts = endpoint_options(self.device, transport, listen=True)
        handle, ip, port = await self.request(
            "start", role=role, cluster_id=cluster_id, options=opts
        )
        try:
            yield PeerEndpoint(self, handle, (ip, port))
        finally:
            with anyio.CancelScope(shield=True):
                await self.request("stop", ep=handle)

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not within 15 s."""
        with contextlib.suppress(PeerCommandError, OSError):
            self.call("exit")
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PeerEndpoint:
    """One endpoint of the child; ``listen`` is its address."""

    def __init__(self, peer: TorchPeer, handle: int, listen: tuple[str, int]) -> None:
        self.peer, self.handle, self.listen = peer, handle, listen

    async def register(
        self,
        layout: str,
        num_blocks: int,
        block_shape: list[int],
        count: int,
        *,
        dtype: str = "uint8",
        model_id: int = 0,
        seed: int | None = None,
    ) -> int:
        """Register a blocks cache of torch tensors there (see ``_torch_peer.Server.register``);
        its id. Raises PeerCommandError."""
        return int(
            await self.peer.request(
                "register",
                ep=self.handle,
                layout=layout,
                num_blocks=num_blocks,
                block_shape=block_shape,
                count=count,
                dtype=dtype,
                model_id=model_id,
                seed=seed,
            )
        )

    async def rows(self, cache_id: int, tensor: int, num_blocks: int) -> np.ndarray:
        """Every block of tensor ``tensor`` there, as bytes ``[num_blocks, block_bytes]``."""
        import base64

        data = await self.peer.request(
            "read", ep=self.handle, cache_id=cache_id, tensor=tensor, rows=list(range(num_blocks))
        )
        return np.frombuffer(base64.b64decode(data), np.uint8).reshape(num_blocks, -1)

    async def fill(self, cache_id: int, value: int) -> None:
        await self.peer.request("fill", ep=self.handle, cache_id=cache_id, value=value)


# ---------------------------------------------------------------------- host references
def reference(seed: int, tensor: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """What the child wrote into tensor ``tensor`` of a cache registered with ``seed``, as
    bytes ``[num_blocks, block_bytes]``."""
    return pattern(seed + tensor, num_blocks * block_bytes).reshape(num_blocks, block_bytes)


def as_rows(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's bytes on the host, one row per block (dim 0)."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.reshape(t.shape[0], -1).view(torch.uint8).cpu().numpy()


def write_bytes(t: torch.Tensor, data: np.ndarray) -> None:
    """Copy host bytes ``data`` over all of ``t`` (queued on the current stream on CUDA)."""
    t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(data).ravel()))


def sync(device: str) -> None:
    """Wait for the device (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def shuffled(num_blocks: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """``count`` distinct source and destination blocks, each in a random order."""
    rng = np.random.default_rng(seed)
    return (
        rng.permutation(num_blocks)[:count].tolist(),
        rng.permutation(num_blocks)[:count].tolist(),
    )
