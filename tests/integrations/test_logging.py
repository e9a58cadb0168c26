"""Logging: messages carry their fields, and LLMDD_ASYNC_LOG shows events without any setup."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import library_logs_enabled

import llmdd_async as dd
from llmdd_async import _log
from llmdd_async.testing import free_port

pytestmark = pytest.mark.anyio


#: A real endpoint that starts and fails one link, then stops.
_SCRIPT = textwrap.dedent(
    """
    import sys
    {setup}
    import anyio
    import llmdd_async as dd

    async def main():
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            {{"llm.EnableCacheManager": "1"}}
        ) as d:
            ci = dd.LLMClusterInfo()
            ci.remote_cluster_id = 1
            ci.append_local_ip_info("127.0.0.1", 0)
            ci.append_remote_ip_info("127.0.0.1", {port})
            await d.link_clusters([ci], 2000)

    anyio.run(main)
    """
)


def _run(setup: str = "", **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != _log.ENV_VAR}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(setup=setup, port=free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_message_is_the_event_then_its_fields(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    library_logs_enabled(monkeypatch)
    log = _log.get_logger("link", peer_cluster_id=1)
    with caplog.at_level(logging.INFO, logger="llmdd_async.link"):
        log.info("link.failed", reason="connection refused", attempt=2)
    (record,) = caplog.records
    assert record.name == "llmdd_async.link"
    assert (
        record.getMessage() == "link.failed peer_cluster_id=1 reason='connection refused' attempt=2"
    )
    # The fields stay record attributes too (structlog's ExtraAdder, filters).
    assert record.reason == "connection refused"  # type: ignore[attr-defined]
    assert record.peer_cluster_id == 1  # type: ignore[attr-defined]


def test_exceptions_are_formatted_by_logging(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    library_logs_enabled(monkeypatch)
    log = _log.get_logger("engine")
    with caplog.at_level(logging.ERROR, logger="llmdd_async.engine"):
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            log.exception("engine.job_crashed", job="f")
    (record,) = caplog.records
    assert record.getMessage() == "engine.job_crashed job='f'"
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError


def test_plain_basicconfig_shows_the_reason() -> None:
    err = _run("import logging; logging.basicConfig(level=logging.INFO)")
    line = next(x for x in err.splitlines() if "link.failed" in x)
    assert line.split(":", 1)[1].startswith("llmdd_async.link:link.failed ")  # INFO or WARNING
    assert "cluster_id=2 peer_cluster_id=1 address='127.0.0.1:" in line and " reason='" in line
    assert "INFO:llmdd_async.engine:engine.up" in err


def test_env_var_shows_events_on_stderr_without_setup() -> None:
    assert "link.failed" not in _run()  # silent by default
    err = _run(**{_log.ENV_VAR: "debug"})
    assert "llmdd_async.engine: engine.up" in err
    assert "llmdd_async.link: link.failed" in err
    assert "reason=" in err
    err = _run(**{_log.ENV_VAR: "ERROR"})
    assert "link.failed" not in err and "engine.up" not in err


def test_env_var_leaves_the_applications_logging_alone() -> None:
    setup = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.ERROR, format="ROOT %(name)s %(message)s")
        import llmdd_async._log
        root = logging.getLogger()
        assert root.level == logging.ERROR and len(root.handlers) == 1, root.handlers
        pkg = logging.getLogger("llmdd_async")
        assert pkg.level == logging.INFO and pkg.propagate
        """
    )
    err = _run(setup, **{_log.ENV_VAR: "info"})
    assert "llmdd_async.link: link.failed" in err  # our handler
    assert "ROOT llmdd_async.link link.failed" in err  # and the application's, untouched


def test_configure_from_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = logging.getLogger("llmdd_async")
    monkeypatch.setattr(pkg, "level", pkg.level)
    monkeypatch.setattr(pkg, "handlers", list(pkg.handlers))
    monkeypatch.setattr(_log, "_env_handler", None)
    assert _log.configure_from_env({}) is None
    assert _log.configure_from_env({_log.ENV_VAR: " "}) is None
    with pytest.warns(RuntimeWarning, match="not a logging level"):
        assert _log.configure_from_env({_log.ENV_VAR: "loud"}) is None
    handler = _log.configure_from_env({_log.ENV_VAR: "Debug"})
    assert handler is not None and handler in pkg.handlers and pkg.level == logging.DEBUG
    assert _log.configure_from_env({_log.ENV_VAR: "30"}) is handler  # attached once
    assert pkg.level == logging.WARNING and pkg.handlers.count(handler) == 1


async def test_a_real_event_reaches_caplog_with_its_fields(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    library_logs_enabled(monkeypatch)
    with caplog.at_level(logging.INFO, logger="llmdd_async"):
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 7).running(
            {"llm.EnableCacheManager": "1"}
        ) as d:
            ci = dd.LLMClusterInfo()
            ci.remote_cluster_id = 1
            ci.append_local_ip_info("127.0.0.1", 0)
            ci.append_remote_ip_info("127.0.0.1", free_port())
            await d.link_clusters([ci], 2000)
    msgs = [r.getMessage() for r in caplog.records if r.name == "llmdd_async.link"]
    assert any(m.startswith("link.failed cluster_id=7 ") and "reason=" in m for m in msgs), msgs


async def test_a_normal_unlink_logs_no_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import cluster, endpoint_options, link

    library_logs_enabled(monkeypatch)
    caplog.set_level(logging.INFO, logger="llmdd_async")
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
            assert await d.unlink_clusters([cluster(1)]) == (
                dd.LLMStatusCode.LLM_SUCCESS,
                [dd.LLMStatusCode.LLM_SUCCESS],
            )
            assert await p.unlink_clusters([cluster(2)]) == (
                dd.LLMStatusCode.LLM_SUCCESS,
                [dd.LLMStatusCode.LLM_SUCCESS],
            )
    downs = [r for r in caplog.records if r.getMessage().startswith("link.down")]
    assert downs  # the unlink was logged...
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # ...calmly
