"""Who hears of an endpoint's transfers and links as they happen (``llmdd_async.metrics``).

An endpoint calls its observers from the event loop, at a transfer's start and end and when a
link comes up or goes down. An observer must be quick (a counter's increment); one that
raises is logged and the transfer or link goes on as if it had not been told.
"""

from __future__ import annotations

from typing import Protocol

from ._enums import LLMStatusCode
from ._log import get_logger

__all__ = ["Observer", "Observers"]

_log = get_logger("observe")


class Observer(Protocol):
    """What an endpoint tells an observer (all on the event loop)."""

    def transfer_started(self, kind: str) -> None:
        """A task of ``kind`` (``pull_blocks``, ``transfer_cache_async``, ...) started."""

    def transfer_ended(self, kind: str, status: LLMStatusCode, nbytes: int, seconds: float) -> None:
        """It ended with ``status`` after moving ``nbytes`` in ``seconds`` (wall time)."""

    def link_changed(self, peer_cluster_id: int, transport: str, up: bool) -> None:
        """The link to ``peer_cluster_id`` (over ``transport``) came up or went down."""


class Observers:
    """The observers of one endpoint."""

    def __init__(self) -> None:
        self._all: list[Observer] = []

    def add(self, observer: Observer) -> None:
        if observer not in self._all:
            self._all.append(observer)

    def remove(self, observer: Observer) -> None:
        if observer in self._all:
            self._all.remove(observer)

    def transfer_started(self, kind: str) -> None:
        for o in self._all:
            try:
                o.transfer_started(kind)
            except Exception:
                _log.exception("observer.failed", observer=repr(o))

    def transfer_ended(self, kind: str, status: LLMStatusCode, nbytes: int, seconds: float) -> None:
        for o in self._all:
            try:
                o.transfer_ended(kind, status, nbytes, seconds)
            except Exception:
                _log.exception("observer.failed", observer=repr(o))

    def link_changed(self, peer_cluster_id: int, transport: str, up: bool) -> None:
        for o in self._all:
            try:
                o.link_changed(peer_cluster_id, transport, up)
            except Exception:
                _log.exception("observer.failed", observer=repr(o))
