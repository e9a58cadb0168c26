"""Links between real processes on 127.0.0.1: link/unlink codes, handshake, auth, roles."""

from __future__ import annotations

import base64
import socket

import pytest
from helpers import cluster, endpoint_options, link

import llmdd_async as dd
from llmdd_async.testing import (
    PeerError,
    PeerProcess,
    free_port,
    has_link,
    wait_link_down,
    wait_link_listed,
)

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode


async def test_link_codes() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            assert await d.link_clusters([cluster(1, p.listen)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            # Linking again, to our own id, a dead port, a wrong id, and without a remote
            # address: per-cluster codes in input order, the overall code is a failing one.
            code, codes = await d.link_clusters(
                [
                    cluster(1, p.listen),
                    cluster(2, p.listen),
                    cluster(7, ("127.0.0.1", free_port())),
                    cluster(9, p.listen),
                    cluster(8),
                ],
                timeout=2000,
            )
            assert codes == [
                S.LLM_ALREADY_LINK,
                S.LLM_PARAM_INVALID,
                S.LLM_LINK_FAILED,
                S.LLM_LINK_FAILED,
                S.LLM_PARAM_INVALID,
            ]
            assert code in codes and code != S.LLM_SUCCESS
            assert await d.link_clusters([]) == (S.LLM_PARAM_INVALID, [])


async def test_link_argument_errors_raise() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        with pytest.raises(TypeError):
            await d.link_clusters([dd.LLMClusterInfo()])  # remote_cluster_id left None
        with pytest.raises(TypeError):
            await d.link_clusters(cluster(1, ("127.0.0.1", 1)))
        with pytest.raises(dd.LLMException) as err:
            await d.link_clusters([cluster(1, ("127.0.0.1", 1))], timeout=0)
        assert err.value.status_code == S.LLM_PARAM_INVALID
        no_local = dd.LLMClusterInfo()
        no_local.remote_cluster_id = 1
        no_local.append_remote_ip_info("127.0.0.1", 1)
        with pytest.raises(dd.LLMException) as err:
            await d.link_clusters([no_local])
        assert err.value.status_code == S.LLM_PARAM_INVALID


async def test_listener_binds_exactly_the_configured_address() -> None:
    port = free_port()
    opts = endpoint_options(**{"llm.listenIpInfo": f"127.0.0.1:{port}"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        assert p.listen_address == ("127.0.0.1", port)
        # Every 127/8 address is this host's loopback; only the configured one must answer.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_host_names_where_upstream_takes_ipv4() -> None:
    """``localhost`` as the listen address (resolved once: 127.0.0.1, bound exactly) and as
    the remote address (resolved when linking); a name that does not resolve fails that
    cluster's link with the name in the reason."""
    opts = endpoint_options(**{"llm.listenIpInfo": "localhost:0"})
    async with (
        dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p,
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d,
    ):
        assert p.listen_address is not None and p.listen_address[0] == "127.0.0.1"
        port = p.listen_address[1]
        named = dd.LLMClusterInfo()
        named.remote_cluster_id = 1
        named.append_local_ip_info("localhost", 0)
        named.append_remote_ip_info("localhost", port)
        assert named.remote_ip_info_list == [("localhost", port)]
        assert await d.link_clusters([named]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert has_link(d, 1)
        nowhere = dd.LLMClusterInfo()
        nowhere.remote_cluster_id = 3
        nowhere.append_local_ip_info("127.0.0.1", 0)
        nowhere.append_remote_ip_info("nothing.invalid", port)
        assert await d.link_clusters([nowhere]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        why = d.link_failure(3)
        assert why is not None and "cannot resolve 'nothing.invalid'" in why, why


async def test_listen_failure_is_reported_at_init() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        opts = endpoint_options(**{"llm.listenIpInfo": f"127.0.0.1:{taken.getsockname()[1]}"})
        with pytest.raises(dd.LLMException) as err:
            async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts):
                pass
        assert err.value.status_code == S.LLM_LINK_FAILED


@pytest.mark.parametrize(
    ("server_key", "client_key", "ok"),
    [
        ("s3cret", "s3cret", True),
        ("s3cret", "wrong", False),
        ("s3cret", None, False),
        (None, "s3cret", False),
    ],
)
async def test_authenticated_handshake(server_key, client_key, ok) -> None:
    sopts = endpoint_options(listen=True)
    copts = endpoint_options()
    if server_key:
        sopts["llm.AuthKey"] = server_key
    if client_key:
        copts["llm.AuthKey"] = client_key
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, sopts) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(copts) as d:
            code, _ = await d.link_clusters([cluster(1, p.listen)], 2000)
            assert code == (S.LLM_SUCCESS if ok else S.LLM_LINK_FAILED)
            assert has_link(d, 1) == ok


async def test_remote_accessible_mode_must_match() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True, ra=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            assert await d.link_clusters([cluster(1, p.listen)]) == (
                S.LLM_PARAM_INVALID,
                [S.LLM_PARAM_INVALID],
            )


async def test_link_is_usable_in_both_directions() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8), dd.BlocksCacheKey(2, 0)
            )
            mine.tensors[0][2] = 9
            theirs = await p.request("alloc", kind="blocks", num_tensors=1, shape=[4, 64])
            # The prompt process (the link's server) pulls from us over the same link.
            code = await p.call(
                "pull_blocks", {"key": ["BlocksCacheKey", 2, 0]}, {"cache": theirs}, [2], [0]
            )
            assert code == 0
            got = await p.request("read", cache_id=theirs, tensor=0)
            assert base64.b64decode(got)[:64] == b"\x09" * 64


async def test_unlink_tells_the_peer_and_force_does_not() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)
            assert await d.unlink_clusters([cluster(1)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            # The peer dropped its side too: its pull over the link fails at once.
            theirs = await p.request("alloc", kind="blocks", num_tensors=1, shape=[4, 64])
            with pytest.raises(PeerError) as err:
                await p.call(
                    "pull_blocks", {"key": ["BlocksCacheKey", 2, 0]}, {"cache": theirs}, [0], [0]
                )
            assert err.value.code == S.LLM_NOT_YET_LINK
            assert await d.unlink_clusters([cluster(1)]) == (
                S.LLM_NOT_YET_LINK,
                [S.LLM_NOT_YET_LINK],
            )
            await link(d, 1, p.listen)
            assert await d.unlink_clusters([cluster(1)], force=True) == (
                S.LLM_SUCCESS,
                [S.LLM_SUCCESS],
            )
            # The peer still believes in the link until it notices the connection is gone.
            await p.request("wait_link_down", cluster_id=2)
            await link(d, 1, p.listen)  # relinking after a force unlink works


async def test_switch_role_needs_no_links_and_moves_the_listener() -> None:
    port = free_port()
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        assert d.listen_address is None
        await d.switch_role(dd.LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
        assert d.role == dd.LLMRole.PROMPT and d.listen_address == ("127.0.0.1", port)
        async with PeerProcess.start(dd.LLMRole.DECODER, 3, endpoint_options()) as peer:
            assert await peer.request("link", cluster_id=2, ip="127.0.0.1", port=port) == [0, [0]]
            await wait_link_listed(d, 3)
            with pytest.raises(dd.LLMException) as err:
                await d.switch_role(dd.LLMRole.DECODER)
            assert err.value.status_code == S.LLM_EXIST_LINK
            await d.unlink_clusters([cluster(3)], force=True)
            await d.switch_role(dd.LLMRole.DECODER)
            assert d.listen_address is None
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_peer_death_is_noticed_and_relinking_works() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
            await link(d, 1, p.listen)
            p.kill()
            await wait_link_down(d, 1)
            # The dead link stays listed until this side unlinks it, which succeeds
            # ("on link faults, both sides must call it").
            with pytest.raises(dd.LLMException) as err:
                d.link_statistics(1)
            # ...and says why it is down.
            assert err.value.status_code == S.LLM_LINK_FAILED
            assert "peer closed the connection" in str(err.value)
            assert await d.unlink_clusters([cluster(1)], force=True) == (
                S.LLM_SUCCESS,
                [S.LLM_SUCCESS],
            )
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
            await link(d, 1, p.listen)
            # A peer that dies again: relinking works without unlinking first, too.
            p.kill()
            await wait_link_down(d, 1)
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
            await link(d, 1, p.listen)


async def test_both_sides_force_unlink_after_a_fault() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)
            assert await p.request("unlink", cluster_id=2, force=True) == [0, [0]]
            await wait_link_down(d, 1)
            assert await d.unlink_clusters([cluster(1)], force=True) == (
                S.LLM_SUCCESS,
                [S.LLM_SUCCESS],
            )
            assert await d.unlink_clusters([cluster(1)], force=True) == (
                S.LLM_NOT_YET_LINK,
                [S.LLM_NOT_YET_LINK],
            )
