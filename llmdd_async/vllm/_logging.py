"""The connector's events in vLLM's logs (``vllm serve`` prints them at INFO).

vLLM configures only its own ``vllm`` logger (``propagate=False``, one stderr/stdout handler
at ``VLLM_LOGGING_LEVEL``), so records of ``llmdd_async.*`` reach no handler inside vLLM. When
the connector is constructed, :func:`route_to_vllm` attaches one handler to the
``llmdd_async`` logger that hands its records to the ``vllm`` logger's handlers (vLLM's
format, stream and level filter), and, if the ``llmdd_async`` logger has no level of its own,
gives it the ``vllm`` logger's level. Nothing else changes: not when vLLM's logging is off
(``VLLM_CONFIGURE_LOGGING=0``: the ``vllm`` logger has no handlers), not when
``LLMDD_ASYNC_LOG`` already routes the events to stderr, and never outside vLLM.
"""

from __future__ import annotations

import logging
import os

from .._log import ENV_VAR

__all__ = ["ToVllmHandler", "route_to_vllm"]

_PACKAGE = "llmdd_async"


class ToVllmHandler(logging.Handler):
    """Hands each record to the handlers of the ``vllm`` logger (as if logged there)."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        for h in vllm_logger.handlers:
            if record.levelno >= h.level:
                h.handle(record)


def route_to_vllm() -> ToVllmHandler | None:
    """Route the ``llmdd_async`` logger's records to vLLM's log handlers, once per process.
    Returns the handler (the one already attached, on a second call), or None when there is
    nothing to do (vLLM's logging is not configured, or ``LLMDD_ASYNC_LOG`` is set)."""
    pkg = logging.getLogger(_PACKAGE)
    for h in pkg.handlers:
        if isinstance(h, ToVllmHandler):
            return h
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or os.environ.get(ENV_VAR, "").strip():
        return None
    handler = ToVllmHandler()
    pkg.addHandler(handler)
    if pkg.level == logging.NOTSET:
        pkg.setLevel(vllm_logger.getEffectiveLevel())
    return handler
