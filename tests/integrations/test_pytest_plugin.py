"""The pytest plugin (``pytest11`` entry point): its fixtures under every async test runner.

Each test writes a small test module into a temporary directory and runs pytest on it in a
subprocess (so the installed entry points load as they do for users): with pytest-asyncio in
auto and in strict mode, and with anyio's plugin on asyncio, uvloop and trio.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# What the inner tests do with the fixtures; each runner's module wraps these in its tests.
BODIES = """
import numpy as np

import llmdd_async as dd
from llmdd_async.testing import encode_key, pattern

DESC = dd.CacheDesc(2, [8, 256], dd.DataType.DT_UINT8)


async def pair_moves_bytes(llmdd_pair):
    async with llmdd_pair() as (prompt, decoder):
        assert prompt.is_initialized() and decoder.is_initialized()
        src = prompt.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(1, 0))
        for i, t in enumerate(src.tensors):
            t[:] = np.arange(8 * 256).reshape(8, 256) * (i + 1) % 251
        dst = decoder.cache_manager.allocate_blocks_cache(DESC, dd.BlocksCacheKey(2, 0))
        await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [1, 2], [5, 6])
        for s, d in zip(src.tensors, dst.tensors):
            assert np.array_equal(d[5:7], s[1:3])
    assert not prompt.is_initialized() and not decoder.is_initialized()  # torn down


async def peer_serves_pattern(llmdd_peer, llmdd_options, loop="asyncio"):
    async with llmdd_peer(dd.LLMRole.PROMPT, 1, loop=loop) as peer:
        await peer.request(
            "alloc", kind="blocks", num_tensors=2, shape=[8, 256],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)), seed=7,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(llmdd_options) as decoder:
            code, _ = await decoder.link_clusters([peer.cluster_info()])
            assert code == dd.LLMStatusCode.LLM_SUCCESS
            dst = decoder.cache_manager.allocate_blocks_cache(DESC)
            await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [3], [0])
            for i, t in enumerate(dst.tensors):
                assert np.array_equal(t[0], pattern(7 + i, 8 * 256).reshape(8, 256)[3])
        process = peer.process
    assert process.returncode is not None  # the child was stopped
"""

ASYNCIO_AUTO = """
from llmdd_inner import pair_moves_bytes, peer_serves_pattern


async def test_pair(llmdd_pair):
    await pair_moves_bytes(llmdd_pair)


async def test_peer(llmdd_peer, llmdd_options):
    await peer_serves_pattern(llmdd_peer, llmdd_options)
"""

ASYNCIO_STRICT = """
import pytest

from llmdd_inner import pair_moves_bytes, peer_serves_pattern


@pytest.mark.asyncio
async def test_pair(llmdd_pair):
    await pair_moves_bytes(llmdd_pair)


@pytest.mark.asyncio
async def test_peer(llmdd_peer, llmdd_options):
    await peer_serves_pattern(llmdd_peer, llmdd_options, loop="trio")


@pytest.mark.asyncio
async def test_options_override(llmdd_pair, llmdd_options):
    llmdd_options["llm.Transport"] = "bogus"
    with pytest.raises(Exception, match="Transport"):
        async with llmdd_pair():
            pass
"""

ANYIO = """
import pytest

from llmdd_inner import pair_moves_bytes, peer_serves_pattern

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
])
def anyio_backend(request):
    return request.param


async def test_pair(llmdd_pair):
    await pair_moves_bytes(llmdd_pair)


async def test_peer(llmdd_peer, llmdd_options):
    await peer_serves_pattern(llmdd_peer, llmdd_options, loop="uvloop")
"""


def run(pytester: pytest.Pytester, module: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(llmdd_inner=BODIES, test_inner=module)
    return pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
        *args,
        timeout=300,
    )


def test_pytest_asyncio_auto_mode(pytester: pytest.Pytester) -> None:
    result = run(pytester, ASYNCIO_AUTO, "--asyncio-mode=auto")
    result.assert_outcomes(passed=2)


def test_pytest_asyncio_strict_mode(pytester: pytest.Pytester) -> None:
    result = run(pytester, ASYNCIO_STRICT, "--asyncio-mode=strict")
    result.assert_outcomes(passed=3)


def test_anyio_plugin(pytester: pytest.Pytester) -> None:
    result = run(pytester, ANYIO)
    result.assert_outcomes(passed=6)


def test_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    result = run(pytester, ASYNCIO_AUTO, "--asyncio-mode=auto", "-p", "no:llmdd_async")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*fixture 'llmdd_pair' not found*"])
