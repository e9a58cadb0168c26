"""Addresses where upstream takes IPv4 only: IPv6 literals and host names too (kept as text,
resolved when linking or, for ``llm.listenIpInfo``, once at start)."""

from __future__ import annotations

import pytest

import llmdd_async as dd
from llmdd_async._cluster import address_of, host_text, ip_to_int, split_host
from llmdd_async._options import parse_listen


def test_ipv4_stays_upstreams_integer_and_the_rest_is_kept_as_text() -> None:
    assert address_of("127.0.0.1") == ip_to_int("127.0.0.1") == 0x0100007F
    assert address_of(0x0100007F) == 0x0100007F
    assert address_of("::1") == address_of("[::1]") == "::1"
    assert address_of("FD00:0:0::0001") == "fd00::1"  # compressed, as Python writes it
    assert address_of("localhost") == "localhost"
    assert address_of("prefill-0.cluster.local") == "prefill-0.cluster.local"
    assert host_text(0x0100007F) == "127.0.0.1" and host_text("::1") == "::1"


@pytest.mark.parametrize("bad", ["bad host", "999.1.1.1", "1.2.3.4.5", "-dash", "a..b", ""])
def test_text_that_is_no_address_raises_runtime_error_as_upstream(bad: str) -> None:
    with pytest.raises(RuntimeError, match="invalid ip address"):
        address_of(bad)
    info = dd.LLMClusterInfo()
    with pytest.raises(RuntimeError):
        info.append_remote_ip_info(bad, 1)
    assert info.remote_ip_info_list == []


def test_cluster_info_lists_and_repr() -> None:
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = 3
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("::1", 5000)
    info.append_remote_ip_info("localhost", 5001)
    assert info.local_ip_info_list == [(0x0100007F, 0)]
    assert info.remote_ip_info_list == [("::1", 5000), ("localhost", 5001)]
    assert "[::1]:5000" in repr(info) and "localhost:5001" in repr(info)
    with pytest.raises(TypeError):
        info.append_remote_ip_info(1.5, 1)  # type: ignore[arg-type]


def test_split_host() -> None:
    assert split_host("[::1]:80", "x") == ("::1", "80")
    assert split_host("host:0", "x") == ("host", "0")
    for bad in ("::1:80", "a:b:c", "[::1]80", "[::1]]:80", "noport"):
        with pytest.raises(ValueError, match="x must be"):
            split_host(bad, "x")


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:7") == ("::1", 7)
    assert parse_listen("localhost:5") == ("127.0.0.1", 5)  # resolved once, IPv4 first
    for bad, words in [
        ("::1:7", r"\[addr\]:port"),
        ("127.0.0.1:1;127.0.0.1:2", "single"),
        ("127.0.0.1:99999", "bad port"),
        ("bad host:1", "does not resolve"),
        ("nothing.invalid:1", "does not resolve"),
    ]:
        with pytest.raises(dd.LLMException, match=words) as err:
            parse_listen(bad)
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID
