"""pytest plugin (entry point ``llmdd_async``, loaded automatically once installed).

The fixtures are plain synchronous fixtures that return *factories*; each factory call is an
async context manager that the test enters on its own event loop::

    async def test_pull(llmdd_pair):
        async with llmdd_pair() as (prompt, decoder):
            ...

So they work the same under pytest-asyncio (auto and strict mode), anyio's pytest plugin
(asyncio, uvloop, trio) or any other runner: no async fixture, no event-loop scope to match.

- ``llmdd_options``: the options both factories start endpoints with (a dict; override this
  fixture in a ``conftest.py`` to change the defaults of a whole directory);
- ``llmdd_peer(role, cluster_id, options=None, loop="asyncio")``: a
  :class:`~llmdd_async.testing.PeerProcess` (an endpoint in a child process, listening on
  ``127.0.0.1:0``);
- ``llmdd_pair(options=None, **kwargs)``: two running endpoints in this process, the decoder
  linked to the prompt (:func:`~llmdd_async.testing.linked_pair`).

Disable the plugin with ``-p no:llmdd_async``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

import llmdd_async as dd
from llmdd_async.testing import PairFactory, PeerFactory, PeerProcess
from llmdd_async.testing._pair import DEFAULT_OPTIONS, LISTEN_ANY, linked_pair

__all__ = ["llmdd_options", "llmdd_pair", "llmdd_peer"]


@pytest.fixture
def llmdd_options() -> dict[str, str]:
    """Options of the endpoints that ``llmdd_peer`` and ``llmdd_pair`` start: cache-manager
    and remote-accessible mode, a 64 MiB device pool and a 16 MiB host pool."""
    return dict(DEFAULT_OPTIONS)


@pytest.fixture
def llmdd_peer(llmdd_options: dict[str, str]) -> PeerFactory:
    """A factory: ``async with llmdd_peer(dd.LLMRole.PROMPT, 1) as peer:`` runs an endpoint
    in a child process (``peer.listen`` is its address) and stops it when the block exits.

    ``options`` are merged over ``llmdd_options`` (plus ``llm.listenIpInfo=127.0.0.1:0``);
    ``loop`` is the child's event loop (``asyncio``, ``uvloop`` or ``trio``). Entering raises
    :class:`~llmdd_async.testing.PeerError` if the endpoint fails to start.
    """

    def start(
        role: dd.LLMRole,
        cluster_id: int,
        options: Mapping[str, str] | None = None,
        loop: str = "asyncio",
    ) -> AbstractAsyncContextManager[PeerProcess]:
        opts = {"llm.listenIpInfo": LISTEN_ANY, **llmdd_options, **(options or {})}
        return PeerProcess.start(role, cluster_id, opts, loop)

    return start


@pytest.fixture
def llmdd_pair(llmdd_options: dict[str, str]) -> PairFactory:
    """A factory: ``async with llmdd_pair() as (prompt, decoder):`` runs two endpoints in this
    process, the decoder linked to the prompt, and stops both when the block exits.

    Takes :func:`~llmdd_async.testing.linked_pair`'s arguments; ``options`` are merged over
    ``llmdd_options``. Entering raises ``LLMException`` if an endpoint fails to start and
    ``RuntimeError`` if linking fails.
    """

    def pair(
        options: Mapping[str, str] | None = None, **kwargs: Any
    ) -> AbstractAsyncContextManager[tuple[dd.LLMDataDist, dd.LLMDataDist]]:
        return linked_pair({**llmdd_options, **(options or {})}, **kwargs)

    return pair
