"""A small asyncio proxy for prefill/decode disaggregation with LlmddConnector (or NixlConnector).

OpenAI ``/v1/completions`` and ``/v1/chat/completions`` in front of one prefill and one decode
``vllm serve``:

* ``--flow sequential`` (vLLM's toy proxy, llm-d): the prefill leg first (``max_tokens=1``,
  ``kv_transfer_params={"do_remote_decode": true}``), then the decode leg with the
  ``kv_transfer_params`` the prefill returned (NixlConnector's keys); works with both modes;
* ``--flow concurrent`` (as Dynamo; for ``mode=layerwise``): both legs at once, each given the
  same fresh capability (``llmdd_capability``, which the prefill would otherwise issue); the
  decode leg names the prefill engine (``--prefill-engine-id``, ``--prefill-side-channel
  host:port``) and carries no block ids, so the prefill pushes each layer into the decode's
  blocks while it computes the next.

Request ids are the proxy's own (a fresh ``X-Request-Id`` per request, sent to both legs); a
client's ``X-Request-Id`` header or ``request_id`` field is never passed on, and a client's
``kv_transfer_params`` are replaced. (Only the capability matters to the connector; knowing a
request id gives nothing, but a client should not choose another's id either.)

Run: ``python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
[--flow concurrent --prefill-side-channel 127.0.0.1:5600] [--port 8000]``.
Streaming responses of the decode leg are passed through as they come.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import uuid
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", required=True, help="prefill server URL")
    p.add_argument("--decode", required=True, help="decode server URL")
    p.add_argument("--flow", choices=["sequential", "concurrent"], default="sequential")
    p.add_argument(
        "--prefill-side-channel",
        default="127.0.0.1:5600",
        help="host:port of the prefill's side_channel (concurrent flow)",
    )
    p.add_argument(
        "--prefill-engine-id",
        default="prefill",
        help="the prefill's kv engine_id (concurrent flow; informational)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p.parse_args(argv)


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=ClientTimeout(total=600))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        path = request.path
        body: dict[str, Any] = await request.json()
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        body.pop("request_id", None)  # vLLM would take it as the request's id
        body.pop("kv_transfer_params", None)
        # never the client's X-Request-Id: the engines' ids are the proxy's own
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        prefill_params: dict[str, Any] = {"do_remote_decode": True}
        cap = None
        if self.args.flow == "concurrent":
            # the decode needs it before the prefill answers: the proxy chooses it
            cap = secrets.token_urlsafe(32)
            prefill_params["llmdd_capability"] = cap
        prefill_body = dict(body, stream=False, max_tokens=1, kv_transfer_params=prefill_params)
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        decode_body = dict(body)
        if self.args.flow == "sequential":
            async with self.session.post(
                self.args.prefill + path, json=prefill_body, headers=headers
            ) as r:
                if r.status != 200:
                    return web.Response(
                        status=r.status, body=await r.read(), content_type="application/json"
                    )
                params = (await r.json()).get("kv_transfer_params")
            decode_body["kv_transfer_params"] = params
            return await self.forward(request, path, decode_body, headers)
        # concurrent: vLLM 0.32's OpenAI server names the prefill's request
        # "cmpl-<X-Request-Id>-0" (completions, one prompt) or "chatcmpl-<X-Request-Id>"
        chat = path.endswith("chat/completions")
        remote_id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}-0"
        host, port = self.args.prefill_side_channel.rsplit(":", 1)
        decode_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "remote_engine_id": self.args.prefill_engine_id,
            "remote_host": host,
            "remote_port": int(port),
            "remote_request_id": remote_id,
            "tp_size": 1,
            "pp_size": 1,
            "llmdd_capability": cap,
        }
        prefill = asyncio.ensure_future(
            self.session.post(self.args.prefill + path, json=prefill_body, headers=headers)
        )
        try:
            return await self.forward(request, path, decode_body, headers)
        finally:
            # The decode leg's answer stands whatever the prefill leg did (it failed: the
            # decode recomputed the prompt).
            try:
                resp = await prefill
                resp.release()
            except Exception as exc:
                print(json.dumps({"prefill_leg_failed": repr(exc), "request_id": rid}))

    async def forward(
        self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(self.args.decode + path, json=body, headers=headers) as r:
            if not body.get("stream"):
                return web.Response(
                    status=r.status, body=await r.read(), content_type="application/json"
                )
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proxy = Proxy(args)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}", "flow": args.flow}))
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
