"""Structured loggers with stable names, routed through the standard ``logging`` module.

Library code never prints: events go to ``logging.getLogger("llmdd_async.<area>")`` (areas:
``engine``, ``link``, ``transfer``; a NullHandler sits on the package logger), so
applications decide where they end up. A record's message is the event name followed by its
fields as ``key=value`` (``link.failed cluster_id=2 address='127.0.0.1:1' reason='...'``), so
plain ``logging.basicConfig()`` shows everything; the fields are also record attributes (the
``extra`` of the call) for structlog's ``ProcessorFormatter`` / ``ExtraAdder``. Event names are
stable: ``link.up``, ``link.down``, ``transfer.started``, ``transfer.complete``,
``transfer.failed``, ...

Setting the environment variable ``LLMDD_ASYNC_LOG`` to a level (``debug``, ``info``,
``warning``, ``error``, ``critical`` or a number) before the package is imported attaches one
stderr handler to the ``llmdd_async`` logger at that level; nothing else in the application's
logging configuration changes.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import structlog

__all__ = ["ENV_VAR", "configure_from_env", "get_logger", "render_message"]

#: The environment variable that turns on stderr logging of the library's events.
ENV_VAR = "LLMDD_ASYNC_LOG"
_PACKAGE = "llmdd_async"
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

logging.getLogger(_PACKAGE).addHandler(logging.NullHandler())


def _value(v: Any) -> str:
    return repr(v) if isinstance(v, str | bytes) else str(v)


def render_message(event: str, fields: dict[str, Any]) -> str:
    """``event`` followed by ``key=value`` for every field (strings quoted), in order."""
    return " ".join([event, *(f"{k}={_value(v)}" for k, v in fields.items())])


def _render_to_log_kwargs(_: logging.Logger, __: str, event_dict: Any) -> Any:
    # Like structlog.stdlib.render_to_log_kwargs, but the message carries the fields too.
    # exc_info / stack_info / stacklevel stay logging keywords: logging formats tracebacks.
    kwargs = {k: event_dict.pop(k) for k in structlog.stdlib.LOG_KWARG_NAMES if k in event_dict}
    event = str(event_dict.pop("event"))
    return {"msg": render_message(event, event_dict), "extra": event_dict, **kwargs}


_PROCESSORS: list[Any] = [structlog.stdlib.filter_by_level, _render_to_log_kwargs]


def _parse_level(text: str) -> int | None:
    text = text.strip()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    return level if isinstance(level, int) else None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


_env_handler: logging.Handler | None = None


def configure_from_env(environ: Any = None) -> logging.Handler | None:
    """Apply ``LLMDD_ASYNC_LOG``: attach (once) a stderr handler to the ``llmdd_async`` logger
    and set that logger's level. Returns the handler, or None when the variable is unset or
    empty. An unknown level gives a ``RuntimeWarning`` and changes nothing; it never raises."""
    global _env_handler
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not text.strip():
        return None
    level = _parse_level(text)
    if level is None:
        warnings.warn(
            f"{ENV_VAR}={text!r} is not a logging level (debug, info, warning, error, "
            "critical or a number): ignored",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    logger = logging.getLogger(_PACKAGE)
    if _env_handler is None:
        _env_handler = _StderrHandler()
        _env_handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(_env_handler)
    logger.setLevel(level)
    return _env_handler


configure_from_env()


def get_logger(area: str, **bound: Any) -> Any:
    """A structlog BoundLogger over the stdlib logger ``llmdd_async.<area>``."""
    std = logging.getLogger(f"{_PACKAGE}.{area}")
    return structlog.wrap_logger(
        std, processors=_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger
    ).bind(**bound)
