"""Mistakes that used to pass silently: misspelt option keys, memory of the wrong element type."""

from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np
import pytest
from helpers import cm_options, library_logs_enabled

import llmdd_async as dd
from llmdd_async._options import KNOWN_OPTIONS, option_key_hints

pytestmark = pytest.mark.anyio
S = dd.LLMStatusCode
DT = dd.DataType


# ------------------------------------------------------------------ option keys
@pytest.fixture(autouse=True)
def _engine_logger_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    library_logs_enabled(monkeypatch)


def _option_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("option.unknown")]


async def test_a_misspelt_key_names_the_closest_known_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opts = cm_options(**{"llm.Trasnport": "tcp", "vendor.SomethingElse": "1"})
    with caplog.at_level(logging.WARNING, logger="llmdd_async"):
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 3).running(opts) as d:
            assert d.is_initialized()  # unknown keys stay accepted, as upstream
    (record,) = _option_warnings(caplog)
    assert record.levelno == logging.WARNING and record.name == "llmdd_async.engine"
    assert record.key == "llm.Trasnport"  # type: ignore[attr-defined]
    assert record.did_you_mean == "llm.Transport"  # type: ignore[attr-defined]
    assert "did_you_mean='llm.Transport'" in record.getMessage()


async def test_known_keys_and_llmconfig_output_raise_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = dd.LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 2000
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.mem_pool_cfg = '{"memory_size": 1048576}'
    cfg.link_total_time = 5
    cfg.link_retry_count = 2
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    opts = cfg.generate_options()
    opts.update({"llm.Transport": "tcp", "llm.LayerWindow": "2", "llm.CopyThreads": "1"})
    with caplog.at_level(logging.WARNING, logger="llmdd_async"):
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 3).running(opts):
            pass
    assert _option_warnings(caplog) == []


def test_option_key_hints() -> None:
    assert option_key_hints({k: "" for k in KNOWN_OPTIONS}) == []
    assert option_key_hints(
        {
            "llm.listenipinfo": "",  # letter case
            "llm.ListenIpInfo": "",  # the C++ spelling, given to the Python API
            "ge.exec.deviceid": "",
            "llm.EnableCacheManger": "",
            "llm.LayerWindw": "",
            "ge.graphRunMode": "",  # a GE option: passed through, not ours to judge
            "llm.SomethingNew": "",  # nothing close
        }
    ) == [
        ("llm.listenipinfo", "llm.listenIpInfo"),
        ("llm.ListenIpInfo", "llm.listenIpInfo"),
        ("ge.exec.deviceid", "ge.exec.deviceId"),
        ("llm.EnableCacheManger", "llm.EnableCacheManager"),
        ("llm.LayerWindw", "llm.LayerWindow"),
    ]


# ------------------------------------------------------------------ element types
def _param_invalid(fn, *args) -> str:
    with pytest.raises(dd.LLMException) as info:
        fn(*args)
    assert info.value.status_code == S.LLM_PARAM_INVALID
    return str(info.value)


async def test_typed_arrays_must_match_the_cache_desc(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    desc = dd.CacheDesc(2, [4, 8], DT.DT_FLOAT16)
    wrong = [np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)]
    msg = _param_invalid(cm.register_cache, desc, wrong)
    assert "float32" in msg and "DT_FLOAT16" in msg
    _param_invalid(cm.register_blocks_cache, desc, wrong, dd.BlocksCacheKey(1, 0))
    half = [np.zeros((4, 8), np.float16), np.zeros((4, 8), np.float32)]
    assert "addrs[1]" in _param_invalid(cm.register_cache, desc, half)
    big_endian = [np.zeros((4, 8), ">f2"), np.zeros((4, 8), ">f2")]
    assert ">f2" in _param_invalid(cm.register_cache, desc, big_endian)
    typed_view = [memoryview(np.zeros(32, np.int16)), memoryview(np.zeros(32, np.int16))]
    assert "int16" in _param_invalid(cm.register_cache, desc, typed_view)
    # nothing was registered by the refused calls: the right arrays register now
    good = [np.zeros((4, 8), np.float16), np.ones((4, 8), np.float16)]
    cache = cm.register_blocks_cache(desc, good, dd.BlocksCacheKey(1, 0))
    assert cache.tensors[1].dtype == np.float16 and cache.tensors[1].sum() == 32


async def test_untyped_memory_and_addresses_stay_accepted(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    desc = dd.CacheDesc(1, [4, 8], DT.DT_FLOAT16)
    nbytes = desc.size
    cm.register_cache(desc, [np.zeros(nbytes, np.uint8)])
    cm.register_cache(desc, [bytearray(nbytes)])
    m = mmap.mmap(-1, nbytes)
    cm.register_cache(desc, [m])
    raw = (ctypes.c_char * nbytes)()
    cm.register_cache(desc, [ctypes.addressof(raw)])
    cm.register_cache(desc, [np.zeros(nbytes // 2, "V2")])
    bf16 = dd.CacheDesc(1, [4, 8], DT.DT_BF16)
    cm.register_cache(bf16, [np.zeros((4, 8), np.uint16)])  # numpy's stand-in for bfloat16
    with pytest.raises(dd.LLMException):
        cm.register_cache(bf16, [np.zeros((4, 8), np.float16)])


async def test_smaller_memory_is_refused_larger_is_a_prefix(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    desc = dd.CacheDesc(1, [4, 8], DT.DT_FLOAT)
    assert "bytes" in _param_invalid(cm.register_cache, desc, [np.zeros((3, 8), np.float32)])
    big = np.arange(64, dtype=np.float32).reshape(8, 8)
    cache = cm.register_cache(desc, [big])  # documented: the first desc.size bytes
    assert cache.tensors[0].shape == (4, 8)
    assert np.array_equal(cache.tensors[0], big[:4])


async def test_torch_tensors_are_checked_by_their_dtype(datadist: dd.LLMDataDist) -> None:
    torch = pytest.importorskip("torch")
    cm = datadist.cache_manager
    desc = dd.CacheDesc(1, [4, 8], DT.DT_FLOAT16)
    msg = _param_invalid(cm.register_cache, desc, [torch.zeros(4, 8, dtype=torch.float32)])
    assert "float32" in msg
    cm.register_cache(desc, [torch.zeros(4, 8, dtype=torch.float16)])
    cm.register_cache(desc, [torch.zeros(64, dtype=torch.uint8)])
    bf16 = dd.CacheDesc(1, [4, 8], DT.DT_BF16)
    _param_invalid(cm.register_cache, bf16, [torch.zeros(4, 8, dtype=torch.float16)])
    t = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
    cache = cm.register_cache(bf16, [t])  # numpy has no bfloat16: registered as its bytes
    assert cache.tensor_addrs == [t.data_ptr()]
    assert np.array_equal(cache.tensors[0], t.view(torch.uint16).numpy())


# ------------------------------------------------------------------ layer signals
def test_layer_events_check_their_indices() -> None:
    events = dd.LayerEvents(num_layers=4)
    events.layer_ready(3)
    events.layer_ready(np.int64(2))  # numpy's integers are ints
    for bad in (4, -1):
        with pytest.raises(dd.LLMException) as err:
            events.layer_ready(bad)
        assert err.value.status_code == S.LLM_PARAM_INVALID
    for wrong in ("a", 1.0, True, None):
        with pytest.raises(TypeError):
            events.layer_ready(wrong)  # type: ignore[arg-type]
    assert events.is_layer_ready(3) and not events.is_layer_ready(4)
    with pytest.raises(dd.LLMException):
        dd.LayerEvents(num_layers=0)
    dd.LayerEvents().layer_ready(10_000)  # no count given: any index >= 0
    with pytest.raises(dd.LLMException):
        dd.LayerEvents().layer_ready(-1)


def test_busy_polling_under_the_blocking_api_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The facade's loop thread would hold the GIL its callers need (docs: tuning)."""
    from llmdd_async import sync

    def warned() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "busy_poll_with_blocking_calls" in r.getMessage()]

    for value, want in (("500", 1), ("0", 0), ("000", 0)):
        caplog.clear()
        d = sync.LLMDataDist(dd.LLMRole.PROMPT, 7)
        with caplog.at_level(logging.WARNING, logger="llmdd_async"):
            d.init(cm_options(**{"llm.BusyPoll": value}))
        try:
            assert len(warned()) == want, value
        finally:
            d.finalize()
