"""How a transfer request names the target's cache (:class:`Address`, XFER_REQ's
``target``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .fields import By, bad_field, enum_field, int_field

__all__ = ["Address"]


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    """How a request names the target's cache: by a request/prefix key (``id``,
    ``model_id``), a blocks key (``model_id``), a cache id (``cache_id``, batch ``index``) or
    raw addresses (the request's ``raw_addrs``)."""

    by: By
    id: int = 0
    model_id: int = 0
    cache_id: int = 0
    index: int = 0

    def encode(self) -> dict[str, Any]:
        by = self.by
        if by is By.REQ_KEY or by is By.PREFIX_KEY:
            return {"by": by, "id": self.id, "model_id": self.model_id}
        if by is By.BLOCKS_KEY:
            return {"by": by, "model_id": self.model_id}
        if by is By.CACHE_ID:
            return {"by": by, "cache_id": self.cache_id, "index": self.index}
        return {"by": by}

    @classmethod
    def decode(cls, raw: Any) -> Address:
        """Raises:
        ProtocolError: not an object, an unknown ``by``, or a field it needs missing or
            malformed."""
        if not isinstance(raw, dict):
            raise bad_field("target", raw)
        by = enum_field(By, raw.get("by"), "addressing")
        if by is By.REQ_KEY or by is By.PREFIX_KEY:
            return cls(
                by,
                id=int_field(raw.get("id"), "key id"),
                model_id=int_field(raw.get("model_id"), "model id"),
            )
        if by is By.BLOCKS_KEY:
            return cls(by, model_id=int_field(raw.get("model_id"), "model id"))
        if by is By.CACHE_ID:
            return cls(
                by,
                cache_id=int_field(raw.get("cache_id"), "cache id"),
                index=int_field(raw.get("index", 0), "batch index"),
            )
        return cls(by)
