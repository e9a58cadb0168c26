"""Every face of the API keeps upstream's parameter names and defaults, and the faces agree.

The async managers define each method once; the blocking facade, the legacy delegates and the
multi-device manager are made from those definitions (``llmdd_async._faces.face_of``) or are
thin delegates. This test is what notices a drift: a face whose parameters differ from
upstream's (``UPSTREAM_*`` below, taken from ``../shared/reference/llm_datadist_api.md`` §6-§8,
§11) or from the other faces of the same method (``inspect.signature``).

Rule for extensions: upstream's parameters come first, in upstream's order, with upstream's
names, kinds and defaults; a face may add keyword-only parameters with defaults after them
(``transfer_cache_async(..., *, tensor_num_per_layer=2)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import llmdd_async as dd
import llmdd_async.sync as s
from llmdd_async._compat.multi_device import MultiDeviceKvCacheManager
from llmdd_async._kv_cache_manager import KvCacheManager as AsyncKvCacheManager

#: no default (a required parameter)
REQ = inspect.Parameter.empty
#: ``**kwargs`` (any name), or keyword-only parameters with defaults in its place
KW = "**"

Spec = list[tuple[str, Any]]

# ---------------------------------------------------------------------- upstream (reference)
#: §8 CacheManager [CM]
UPSTREAM_CACHE_MANAGER: dict[str, Spec] = {
    "register_cache": [
        ("cache_desc", REQ),
        ("addrs", REQ),
        ("cache_keys", ()),
        ("remote_accessible", None),
    ],
    "register_blocks_cache": [
        ("cache_desc", REQ),
        ("addrs", REQ),
        ("blocks_cache_key", None),
        ("remote_accessible", None),
    ],
    "unregister_cache": [("cache_id", REQ)],
    "pull_cache": [("cache_key", REQ), ("cache", REQ), ("batch_index", 0), ("size", -1), KW],
    "pull_blocks": [
        ("src_cache_key", REQ),
        ("dst_cache", REQ),
        ("src_blocks", ()),
        ("dst_blocks", ()),
        KW,
    ],
    "push_cache": [
        ("dst_cache_key", REQ),
        ("src_cache", REQ),
        ("src_batch_index", 0),
        ("src_layer_range", None),
        ("dst_layer_range", None),
        ("size", -1),
        ("tensor_num_per_layer", 2),
    ],
    "push_blocks": [
        ("dst_cache_key", REQ),
        ("src_cache", REQ),
        ("src_blocks", ()),
        ("dst_blocks", ()),
        ("src_layer_range", None),
        ("dst_layer_range", None),
        ("tensor_num_per_layer", 2),
    ],
    "transfer_cache_async": [
        ("src_cache", REQ),
        ("layer_synchronizer", REQ),
        ("transfer_configs", REQ),
        ("src_block_indices", None),
        ("dst_block_indices", None),
        ("dst_block_memory_size", None),
    ],
    "remap_registered_memory": [("mem_infos", REQ)],
    "allocate_cache": [("cache_desc", REQ), ("cache_keys", ())],
    "allocate_blocks_cache": [("cache_desc", REQ), ("blocks_cache_key", None)],
    "deallocate_cache": [("cache", REQ)],
    "deallocate_blocks_cache": [("cache", REQ)],
    "remove_cache_key": [("cache_key", REQ)],
    "copy_cache": [
        ("dst", REQ),
        ("src", REQ),
        ("dst_batch_index", 0),
        ("src_batch_index", 0),
        ("offset", 0),
        ("size", -1),
        ("req_id", None),
    ],
    "copy_blocks": [("cache", REQ), ("copy_block_info", REQ)],
    "swap_blocks": [("src_cache", REQ), ("dst_cache", REQ), ("src_to_dst", REQ)],
}

#: §11 KvCacheManager [KVM]
UPSTREAM_KV_CACHE_MANAGER: dict[str, Spec] = {
    "is_initialized": [],
    "allocate_cache": [("cache_desc", REQ), ("cache_keys", ())],
    "allocate_blocks_cache": [("cache_desc", REQ), ("blocks_cache_key", None)],
    "deallocate_cache": [("cache", REQ)],
    "remove_cache_key": [("cache_key", REQ)],
    "pull_cache": [("cache_key", REQ), ("kv_cache", REQ), ("batch_index", 0), ("size", -1), KW],
    "pull_blocks": [
        ("prompt_cache_key", REQ),
        ("decoder_kv_cache", REQ),
        ("prompt_blocks", REQ),
        ("decoder_blocks", REQ),
        KW,
    ],
    "copy_cache": UPSTREAM_CACHE_MANAGER["copy_cache"],
    "copy_blocks": [("cache", REQ), ("copy_block_info", REQ)],
    "get_cache_tensors": [("cache", REQ), ("tensor_index", 0)],
    "swap_blocks": [("src", REQ), ("dst", REQ), ("src_to_dst", REQ)],
    "transfer_cache_async": UPSTREAM_CACHE_MANAGER["transfer_cache_async"],
}

#: §6 LLMDataDist [both] (``init``/``finalize`` are coroutines on the async face)
UPSTREAM_LLM_DATADIST: dict[str, Spec] = {
    "__init__": [("role", REQ), ("cluster_id", REQ)],
    "init": [("options", REQ)],
    "finalize": [],
    "link_clusters": [("clusters", REQ), ("timeout", 3000)],
    "unlink_clusters": [("clusters", REQ), ("timeout", 3000), ("force", False)],
    "switch_role": [("role", REQ), ("switch_options", None)],
    "link": [("comm_name", REQ), ("cluster_rank_info", REQ), ("rank_table", REQ)],
    "unlink": [("comm_id", REQ)],
    "query_register_mem_status": [("comm_id", REQ)],
    "check_link_status": [("remote_cluster_id", REQ)],
}

#: §7 CacheTask [both]
UPSTREAM_CACHE_TASK: dict[str, Spec] = {
    "synchronize": [("timeout_in_millis", None)],
    "get_results": [("timeout_in_millis", None)],
}

#: the faces of each API: (upstream table, classes that must all show it)
FACES: dict[str, tuple[dict[str, Spec], list[type]]] = {
    "CacheManager": (UPSTREAM_CACHE_MANAGER, [dd.CacheManager, s.CacheManager]),
    "KvCacheManager": (
        UPSTREAM_KV_CACHE_MANAGER,
        [AsyncKvCacheManager, s.KvCacheManager, MultiDeviceKvCacheManager],
    ),
    "LLMDataDist": (UPSTREAM_LLM_DATADIST, [dd.LLMDataDist, s.LLMDataDist]),
    "CacheTask": (UPSTREAM_CACHE_TASK, [dd.CacheTask, s.CacheTask]),
}


# ---------------------------------------------------------------------- comparison
def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters of a method as the caller sees them (``self`` dropped)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


def _shape(p: inspect.Parameter) -> tuple[str, Any, Any]:
    """What callers depend on: name (any for ``**kwargs``), kind, default."""
    name = KW if p.kind is p.VAR_KEYWORD else p.name
    return name, p.kind, p.default


def upstream_drift(fn: Callable[..., Any], spec: Spec) -> list[str]:
    """How ``fn``'s parameters differ from upstream's ``spec``; empty when they match."""
    params = _params(fn)
    problems = []
    if spec and spec[-1] == KW and not any(p.kind is p.VAR_KEYWORD for p in params):
        # Upstream's ``**kwargs`` named explicitly, as keyword-only parameters with defaults
        # (callers pass them by name either way; mypy then checks them): checked below.
        spec = spec[:-1]
    want = [
        (KW, inspect.Parameter.VAR_KEYWORD, REQ)
        if item == KW
        else (item[0], inspect.Parameter.POSITIONAL_OR_KEYWORD, item[1])
        for item in spec
    ]
    got = [_shape(p) for p in params]
    if got[: len(want)] != want:
        problems.append(f"upstream's parameters {want} but the face has {got[: len(want)]}")
    for p in params[len(want) :]:
        if p.kind is not p.KEYWORD_ONLY or p.default is REQ:
            problems.append(
                f"extra parameter {p.name!r} must be keyword-only with a default (an extension)"
            )
    return problems


def face_drift(a: Callable[..., Any], b: Callable[..., Any]) -> list[str]:
    """How two faces of one method differ (names, kinds, defaults, in order)."""
    pa, pb = [_shape(p) for p in _params(a)], [_shape(p) for p in _params(b)]
    return [] if pa == pb else [f"{pa} != {pb}"]


# ---------------------------------------------------------------------- the checks
CASES = [
    pytest.param(api, cls, method, id=f"{cls.__module__}.{cls.__qualname__}.{method}")
    for api, (table, classes) in FACES.items()
    for cls in classes
    for method in table
]


@pytest.mark.parametrize(("api", "cls", "method"), CASES)
def test_face_matches_upstream(api: str, cls: type, method: str) -> None:
    table, _ = FACES[api]
    fn = getattr(cls, method, None)
    assert fn is not None, f"{cls.__qualname__} lacks upstream's {method}"
    assert upstream_drift(fn, table[method]) == []


@pytest.mark.parametrize(
    ("api", "method"),
    [
        pytest.param(api, method, id=f"{api}.{method}")
        for api, (table, _) in FACES.items()
        for method in table
    ],
)
def test_faces_agree(api: str, method: str) -> None:
    _, classes = FACES[api]
    first, *others = classes
    for cls in others:
        assert face_drift(getattr(first, method), getattr(cls, method)) == [], cls.__qualname__


def test_extensions_reach_every_face() -> None:
    """The drift the issue named: the facade's transfer_cache_async lacked the extension."""
    for cls in (dd.CacheManager, s.CacheManager, AsyncKvCacheManager, s.KvCacheManager):
        param = inspect.signature(cls.transfer_cache_async).parameters["tensor_num_per_layer"]
        assert (param.kind, param.default) == (inspect.Parameter.KEYWORD_ONLY, 2)


def test_the_comparison_sees_drift() -> None:
    """The checks above would fail on a face that drifted (a guard for the guard)."""

    def renamed(self: Any, cache_key: Any, kv_cache: Any, batch_index: int = 0) -> None: ...

    def new_default(self: Any, cache_key: Any, cache: Any, batch_index: int = 1) -> None: ...

    def extra_positional(self: Any, comm_id: Any, extra: Any = None) -> None: ...

    spec = [("cache_key", REQ), ("cache", REQ), ("batch_index", 0)]
    assert upstream_drift(renamed, spec)
    assert upstream_drift(new_default, spec)
    assert upstream_drift(extra_positional, [("comm_id", REQ)])
    assert face_drift(renamed, new_default)
    assert upstream_drift(dd.CacheManager.pull_cache, UPSTREAM_CACHE_MANAGER["pull_cache"]) == []
