"""Enumerations of the llm_datadist API (reference §2), with upstream's exact values."""

from __future__ import annotations

import enum

__all__ = [
    "DataType",
    "LLMRole",
    "LLMStatusCode",
    "Memtype",
    "Placement",
    "PushType",
    "RegisterMemStatus",
]


class _QualifiedStrIntEnum(enum.IntEnum):
    # Python 3.11 changed IntEnum.__str__ to the bare number; upstream prints "LLMRole.PROMPT".
    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class LLMRole(_QualifiedStrIntEnum):
    """Role label of an endpoint. In cache-manager mode it restricts nothing."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(_QualifiedStrIntEnum):
    """Where a cache lives: host memory or memory of the configured device adapter."""

    HOST = 0
    DEVICE = 1


class DataType(enum.Enum):
    """Element types, valued by GE's ``ge::DataType`` codes."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element.

        Raises:
            ValueError: for ``DT_STRING``, which has no fixed size.
        """
        size = _ITEMSIZE.get(self)
        if size is None:
            raise ValueError(f"{self} has no fixed element size")
        return size

    @property
    def numpy_dtype(self) -> str:
        """numpy dtype string used for views of cache tensors.

        ``DT_BF16`` is exposed as raw ``uint16`` (numpy has no bfloat16); upstream's legacy map
        used float16, which silently misreads the values.

        Raises:
            ValueError: for ``DT_STRING``.
        """
        name = _NUMPY.get(self)
        if name is None:
            raise ValueError(f"{self} has no numpy equivalent")
        return name


_ITEMSIZE = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}

_NUMPY = {
    DataType.DT_FLOAT: "<f4",
    DataType.DT_FLOAT16: "<f2",
    DataType.DT_INT8: "i1",
    DataType.DT_INT32: "<i4",
    DataType.DT_UINT8: "u1",
    DataType.DT_INT16: "<i2",
    DataType.DT_UINT16: "<u2",
    DataType.DT_UINT32: "<u4",
    DataType.DT_INT64: "<i8",
    DataType.DT_UINT64: "<u8",
    DataType.DT_DOUBLE: "<f8",
    DataType.DT_BOOL: "?",
    DataType.DT_BF16: "<u2",
}


class Memtype(enum.Enum):
    """Memory kind of a :class:`MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(enum.Enum):
    """State of a comm-domain link's memory registration. Unknown values map to FAILED."""

    OK = 0
    PREPARING = 1
    FAILED = 2

    @classmethod
    def _missing_(cls, value: object) -> RegisterMemStatus:
        return cls.FAILED


class PushType(enum.Enum):
    """How a push addresses its destination (internal to transfer tuples)."""

    NO_CACHE_KEY = 0
    BLOCKS_CACHE_KEY = 1
    CACHE_KEY_BY_ID = 2


_BASE = 0x5010B000


class LLMStatusCode(_QualifiedStrIntEnum):
    """Status codes; values are GE's (``0x5010B000 | n``) and must not change."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _BASE | 0x01
    LLM_KV_CACHE_NOT_EXIST = _BASE | 0x02
    LLM_REPEAT_REQUEST = _BASE | 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _BASE | 0x04
    LLM_PARAM_INVALID = _BASE | 0x05
    LLM_ENGINE_FINALIZED = _BASE | 0x06
    LLM_NOT_YET_LINK = _BASE | 0x07
    LLM_ALREADY_LINK = _BASE | 0x08
    LLM_LINK_FAILED = _BASE | 0x09
    LLM_UNLINK_FAILED = _BASE | 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE | 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE | 0x0C
    LLM_PROCESSING_LINK = _BASE | 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _BASE | 0x0E
    LLM_PREFIX_ALREADY_EXIST = _BASE | 0x0F
    LLM_PREFIX_NOT_EXIST = _BASE | 0x10
    LLM_SEQ_LENOVERLIMIT = _BASE | 0x11
    LLM_NO_FREE_BLOCK = _BASE | 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE | 0x13
    LLM_EXIST_LINK = _BASE | 0x18
    LLM_FEATURE_NOT_ENABLED = _BASE | 0x19
    LLM_TIMEOUT = _BASE | 0x1A
    LLM_LINK_BUSY = _BASE | 0x1B
    LLM_OUT_OF_MEMORY = _BASE | 0x1C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    @classmethod
    def from_wire(cls, value: int) -> LLMStatusCode:
        """Map a code received from a peer; unknown values become ``LLM_FAILED`` as upstream."""
        # A dict lookup: calling the enum costs a microsecond, on every frame with a status.
        try:
            member = cls._value2member_map_.get(value)
        except TypeError:  # unhashable
            member = None
        return cls.LLM_FAILED if member is None else member  # type: ignore[return-value]
