"""Structured loggers with stable names, routed through the standard ``logging`` module.

Library code never prints: events go to ``logging.getLogger("llmdd_async.<area>")`` (with a
NullHandler on the package logger), so applications decide where they end up, with plain
logging or with structlog's ``ProcessorFormatter``. Event names are stable: ``link.up``,
``link.down``, ``transfer.started``, ``transfer.complete``, ``transfer.failed``, ...
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["get_logger"]

logging.getLogger("llmdd_async").addHandler(logging.NullHandler())

_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.processors.format_exc_info,
    structlog.stdlib.render_to_log_kwargs,
]


def get_logger(area: str, **bound: Any) -> Any:
    """A structlog BoundLogger over the stdlib logger ``llmdd_async.<area>``."""
    std = logging.getLogger(f"llmdd_async.{area}")
    return structlog.wrap_logger(
        std, processors=_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger
    ).bind(**bound)
