"""Shared fixtures: every async test runs on asyncio, asyncio+uvloop and trio; remote tests
that take ``transport`` run over every transport."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers import TRANSPORTS, cm_options, use_transport

import llmdd_async as dd

# NIXL's UCX stays on loopback in tests (``nixl`` runs: cma, tcp and self; ``nixl-tcp``: tcp).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "cma,tcp,self")

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run soak and benchmark-like tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
async def datadist() -> AsyncIterator[dd.LLMDataDist]:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(cm_options()) as d:
        yield d


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``llm.Transport`` of each transport a remote test runs over (``tcp``, ``same-host``,
    NIXL where installed); a test's own ``parametrize("transport", ...)`` overrides it."""
    return use_transport(request, monkeypatch)
