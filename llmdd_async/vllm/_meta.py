"""Scheduler -> worker metadata of :class:`LlmddConnector` (plain data, pickle/msgspec-safe)."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

__all__ = [
    "CAPABILITY_KEY",
    "LlmddHandshake",
    "LlmddMetadata",
    "RecvSpec",
    "base_request_id",
    "new_capability",
    "valid_capability",
]

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
#: the ``kv_transfer_params`` key of a request's capability
CAPABILITY_KEY = "llmdd_capability"
_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{22,128}")


def new_capability() -> str:
    """A request's capability: 256 random bits (whoever holds it may read, push, free and
    cancel that request's KV transfer, and nothing else)."""
    return secrets.token_urlsafe(32)


def valid_capability(value: Any) -> TypeGuard[str]:
    """A capability's shape: 22..128 URL-safe characters (at least 128 bits)."""
    return isinstance(value, str) and _CAPABILITY.fullmatch(value) is not None


def base_request_id(req_id: str) -> str:
    """vLLM's external request id: the internal id without the random ``-xxxxxxxx`` suffix."""
    return _SUFFIX.sub("", req_id)


@dataclass
class RecvSpec:
    """A decode request's load: where from, into which blocks."""

    local_blocks: list[int]
    skip_blocks: int  # leading blocks the decode already has (local prefix cache)
    params: dict[str, Any]  # the request's kv_transfer_params (the remote_* keys)


@dataclass
class LlmddHandshake(KVConnectorHandshakeMetadata):
    """One worker's side channel, reported to the scheduler."""

    host: str
    port: int
    cluster_id: int
    tp_rank: int


@dataclass
class LlmddMetadata(KVConnectorMetadata):
    #: decode: requests to load, by request id
    recv: dict[str, RecvSpec] = field(default_factory=dict)
    #: decode: aborted before loading: (host, port, capability) to release on the prefill
    release: list[tuple[str, int, str]] = field(default_factory=list)
    #: prefill: finished requests whose blocks the connector holds -> (lease seconds, blocks)
    send: dict[str, tuple[float, list[int]]] = field(default_factory=dict)
    #: prefill: finished requests that were aborted (layer-wise push to stop)
    aborted: set[str] = field(default_factory=set)
    #: prefill, layer-wise: requests whose prompt completes this step -> their prompt blocks
    save: dict[str, list[int]] = field(default_factory=dict)
    #: prefill: the capability of each request in ``send`` / ``save`` / ``aborted``
    caps: dict[str, str] = field(default_factory=dict)
    #: the step schedules no tokens (only requests waiting for their KV, say)
    idle: bool = False
