"""The test kit's fork server: a forked child stands where ``python -m MODULE`` would, and
a child that a fork could not start the same way gets a fresh interpreter."""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, pattern
from llmdd_async.testing._forkserver import ForkedProcess, ForkServer, fork_server

pytestmark = pytest.mark.anyio

#: what a child prints of itself: what ``python -m`` would have set up
PROBE = (
    "import os, signal, sys; print(repr((os.environ.get('UCX_PROBE'), os.environ.get("
    "'LLMDD_PEER_LOOP'), sys.argv, sys.path[0], os.getcwd(), signal.getsignal(signal.SIGINT)"
    " is signal.default_int_handler, os.getppid() != 0)))\n"
)


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError("no PPid")


def _state(pid: int) -> str | None:
    """The state of process ``pid`` (``Z`` for a zombie); None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", LLMDD_PEER_LOOP="asyncio", **extra)


@pytest.fixture
def server() -> Iterator[ForkServer]:
    """A fork server of this test's own (the process's one started for other tests' env)."""
    fs = ForkServer()
    yield fs
    fs.close()


async def _run(process: anyio.abc.Process, stdin: bytes) -> tuple[bytes, int]:
    """Send ``stdin``, close it, read stdout to its end; the exit code."""
    assert process.stdin is not None and process.stdout is not None
    await process.stdin.send(stdin)
    await process.stdin.aclose()
    out = b""
    with anyio.fail_after(30):
        with contextlib.suppress(anyio.EndOfStream):
            while True:
                out += await process.stdout.receive()
        code = await process.wait()
    await process.aclose()
    return out, code


async def test_a_forked_child_sees_what_a_fresh_interpreter_sees(server: ForkServer) -> None:
    """Run ``python -m code`` (an interpreter reading stdin) both ways and print what it was
    given: the environment (a late variable too), argv, sys.path, cwd, the SIGINT handler."""
    env = _env(UCX_PROBE="7")
    forked = await server.spawn("code", env, False)
    assert isinstance(forked, ForkedProcess), server.broken
    assert forked.pid != os.getpid() and _ppid(forked.pid) == server.pid
    got_forked, code_forked = await _run(forked, PROBE.encode())
    # The reference: as subprocess starts it (uvloop's spawn would also reset the signals
    # this process ignores, which exec keeps ignored and the fork server does too).
    fresh = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.run,
            [sys.executable, "-m", "code"],
            env=env,
            input=PROBE.encode(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
    )
    assert code_forked == fresh.returncode == 0
    assert got_forked == fresh.stdout and b"'7'" in got_forked, (got_forked, fresh.stdout)


#: what differs between two children: their generators, the descriptors they hold
SEEDS = (
    "import os, random, numpy, trio._core._run as r; print(repr((random.random(),"
    " numpy.random.random(), r._r.random(), len(os.listdir('/proc/self/fd')))))\n"
)


async def test_two_children_draw_different_randoms_and_hold_only_their_own_streams(
    server: ForkServer,
) -> None:
    """Generators seeded at import are reseeded in each child; a child holds no descriptor
    a fresh interpreter would not (none of another child's, none of the server's)."""
    pytest.importorskip("trio")
    a = await server.spawn("code", _env(), False)
    b = await server.spawn("code", _env(), False)
    assert a is not None and b is not None
    out_b, _ = await _run(b, SEEDS.encode())  # while a still runs
    out_a, _ = await _run(a, SEEDS.encode())
    fresh = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.run,
            [sys.executable, "-m", "code"],
            env=_env(),
            input=SEEDS.encode(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
    )
    (ra, na, ta, fds_a), (rb, nb, tb, fds_b), (*_, fds_fresh) = (
        ast.literal_eval(out.decode().split(">>> ")[1].strip())
        for out in (out_a, out_b, fresh.stdout)
    )
    assert ra != rb and na != nb and ta != tb
    assert fds_a == fds_b == fds_fresh


async def test_a_child_runs_on_the_cpus_of_the_thread_that_started_it(server: ForkServer) -> None:
    """CPU affinity is a thread's: the server, started from a worker thread, may have other
    CPUs than the caller (a benchmark pins its loop's thread); the child gets the caller's."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        # A machine with one CPU cannot show a child on other CPUs than its server's (CI's
        # machine has two: there this runs).
        pytest.skip("one CPU: nothing to pin to")
    one = {min(cpus)}
    await anyio.to_thread.run_sync(os.getpid)  # a worker thread, unpinned, starts the server
    os.sched_setaffinity(0, one)
    try:
        forked = await server.spawn("code", _env(), False)
    finally:
        os.sched_setaffinity(0, cpus)
    assert forked is not None
    out, _ = await _run(forked, b"import os; print(sorted(os.sched_getaffinity(0)))\n")
    assert f"{sorted(one)}".encode() in out, out


async def test_a_module_that_cannot_run_exits_1_as_with_python_m(server: ForkServer) -> None:
    forked = await server.spawn("llmdd_async_no_such_module", _env(), False)
    assert isinstance(forked, ForkedProcess)
    assert await _run(forked, b"") == (b"", 1)


async def test_a_killed_child_reports_its_signal_and_the_server_reaps_it(
    server: ForkServer,
) -> None:
    forked = await server.spawn("code", _env(), False)
    assert isinstance(forked, ForkedProcess)
    assert forked.returncode is None
    forked.kill()
    with anyio.fail_after(10):
        assert await forked.wait() == -signal.SIGKILL
    assert forked.returncode == -signal.SIGKILL
    assert _state(forked.pid) is None  # reaped: no zombie left
    forked.kill()  # gone: nothing is signalled
    await forked.aclose()


async def test_an_environment_read_before_the_fork_gets_a_fresh_interpreter(
    server: ForkServer,
) -> None:
    """A variable that is not read late (PYTHONPATH, a log level) or another working
    directory: the fork could not stand where ``python -m`` would, so no fork."""
    first = await server.spawn("code", _env(), False)
    assert isinstance(first, ForkedProcess)
    await _run(first, b"")
    assert await server.spawn("code", _env(LLMDD_PROBE_EARLY="1"), False) is None
    late = await server.spawn("code", _env(UCX_PROBE="1", MC_PROBE="2"), False)
    assert late is not None
    await _run(late, b"")
    old = os.umask(0o077)  # what a child inherits besides its environment
    try:
        assert await server.spawn("code", _env(), False) is None
    finally:
        os.umask(old)
    was = signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # an ignored signal stays ignored
    try:
        assert await server.spawn("code", _env(), False) is None
    finally:
        signal.signal(signal.SIGUSR2, was)
    again = await server.spawn("code", _env(), False)
    assert again is not None
    await _run(again, b"")


async def test_the_server_ends_with_its_parents_handle_and_its_children_run_on(
    server: ForkServer,
) -> None:
    forked = await server.spawn("code", _env(), False)
    assert isinstance(forked, ForkedProcess)
    pid = server.pid
    assert pid is not None
    server.close()
    assert _state(pid) is None  # it ended, and its parent (this process) reaped it
    assert _state(forked.pid) not in (None, "Z")
    out, code = await _run(forked, b"print(6 * 7)\n")
    # The code of a child that outlived the server is unknown: reported as a kill.
    assert b"42\n" in out and code == -signal.SIGKILL


#: a parent that forks one child (it reads stdin), prints the two pids, and waits to be killed
PARENT = textwrap.dedent(
    """
    import anyio, os, sys
    from llmdd_async.testing._forkserver import ForkServer
    async def main():
        fs = ForkServer()
        env = dict(os.environ, PYTHONUNBUFFERED="1", LLMDD_PEER_LOOP="asyncio")
        child = await fs.spawn("code", env, False)
        print(fs.pid, child.pid, flush=True)
        await anyio.sleep(60)
    anyio.run(main)
    """
)


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) in (None, "Z"):
            return True
        time.sleep(0.02)
    return False


def test_a_parent_killed_takes_its_server_and_children_with_it() -> None:
    """The server ends when its parent's end of the control socket closes; a child when
    its stdin (held by the parent) does."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, parent.stderr.read() if parent.stderr else ""
        server_pid, child_pid = map(int, line.split())
        assert _state(server_pid) not in (None, "Z") and _state(child_pid) not in (None, "Z")
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(server_pid) and _wait_gone(child_pid)


@contextlib.asynccontextmanager
async def _peer(loop: str, fork: bool) -> AsyncIterator[PeerProcess]:
    opts = {
        "llm.listenIpInfo": "127.0.0.1:0",
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": '{"memory_size": 16777216}',
    }
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts, loop, fork=fork) as p:
        yield p


@pytest.fixture
def loop(anyio_backend: tuple[str, dict[str, bool]]) -> str:
    """The children's event loop: the test's own."""
    name, options = anyio_backend
    return "uvloop" if options.get("use_uvloop") else name


async def test_peers_fork_by_default_and_serve_as_fresh_ones_do(loop: str) -> None:
    shape = [8, 256]
    digests = []
    for fork in (True, False):
        async with _peer(loop, fork) as p:
            assert isinstance(p.process, ForkedProcess) is fork, fork_server().broken
            if fork:
                assert _ppid(p.process.pid) == fork_server().pid
            cid = await p.request(
                "alloc", kind="blocks", num_tensors=2, shape=shape, blocks_key=None, seed=5
            )
            digests.append(await p.request("digest", cache_id=cid))
        assert p.process.returncode == 0
    want = [hashlib.sha256(pattern(5 + t, 8 * 256).tobytes()).hexdigest() for t in range(2)]
    assert digests == [want, want]
