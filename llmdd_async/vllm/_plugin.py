"""``vllm.general_plugins`` entry point: register ``LlmddConnector`` by name.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
before configs are resolved, so ``kv_connector="LlmddConnector"`` works without
``kv_connector_module_path``. Importing vLLM's factory here is cheap; the connector module
itself loads only when an engine asks for it (its import checks the vLLM version).
"""

from __future__ import annotations

import contextlib

__all__ = ["register"]


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # pragma: no cover - another vLLM layout: loading by path still checks
        return
    # registered already (this process called register before): vLLM says so with a
    # ValueError, its only public answer to "is this name taken"
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            "LlmddConnector", "llmdd_async.vllm", "LlmddConnector"
        )
