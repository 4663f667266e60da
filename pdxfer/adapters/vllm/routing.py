"""The HTTP side of ``pdxfer proxy`` (proxy.py says what it does): an aiohttp server that
relays each OpenAI request to a prefill and a decode vLLM engine (docs/engines.md §C2)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from . import params

log = logging.getLogger(__name__)

GENERATE = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
CONNECT_TIMEOUT = 10.0
# vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); one the
# proxy reused at that moment would fail its request ("Server disconnected"), so idle
# connections are dropped well before.
KEEPALIVE = 3.0
MAX_BODY = 64 * 1024 * 1024  # prompts of token ids can be large
HEALTH_TIMEOUT = 5.0  # an engine's /health answers at once unless it is stuck, which counts as down


@dataclass(frozen=True)
class Prefill:
    url: str
    bootstrap: str | None  # its daemon's bootstrap address; the sequential mode needs none


def error(status: int, message: str) -> web.Response:
    """An error in the OpenAI shape vLLM answers with."""
    kind = "BadGatewayError" if status == 502 else "BadRequestError"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)


def prefill_body(path: str, body: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """The prefill computes the prompt and one token, never streams, and takes no
    options that contradict one token (min_tokens)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=kv)
    if path == "/v1/chat/completions":
        out["max_completion_tokens"] = 1
    return out


class Failed(Exception):
    """An engine refused a request or could not be reached: the response to give the client."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


class Proxy:
    def __init__(self, prefills: list[Prefill], decodes: list[str], sequential: bool = False) -> None:
        self.prefills = prefills
        self.decodes = decodes
        self.sequential = sequential
        self._next_prefill = itertools.cycle(prefills)
        self._next_decode = itertools.cycle(decodes)
        # Each prefill engine's TP and PP sizes, which the decode's daemon needs to know
        # which prefill ranks write which heads: as the engine last answered.
        self._sizes: dict[str, params.Sizes] = {}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port); the port it serves on."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
                                              connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE))
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for path in GENERATE:
            app.router.add_post(path, self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for task in list(self._background):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        """200 while a request can be served: some prefill and some decode engine answer
        their own /health; else 503. Either way, what each engine answered."""
        urls = [p.url for p in self.prefills] + self.decodes
        found = dict(zip(urls, await asyncio.gather(*(self._engine_health(url) for url in urls))))
        prefills = {p.url: found[p.url] for p in self.prefills}
        decodes = {url: found[url] for url in self.decodes}
        serving = "ok" in prefills.values() and "ok" in decodes.values()
        return web.json_response({"prefills": prefills, "decodes": decodes, "sequential": self.sequential}, status=200 if serving else 503)

    async def _engine_health(self, url: str) -> str:
        """"ok", or why an engine's /health says it cannot serve."""
        try:
            async with self._session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)) as upstream:
                return "ok" if upstream.status == 200 else f"/health answered {upstream.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"unreachable: {exc or type(exc).__name__}"

    async def _models(self, request: web.Request) -> web.Response:
        url = next(self._next_decode) + "/v1/models"
        try:
            async with self._session.get(url, headers=self._headers(request)) as upstream:
                return web.Response(status=upstream.status, body=await upstream.read(), content_type=upstream.content_type)
        except aiohttp.ClientError as exc:
            return error(502, f"decode engine {url}: {exc}")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            return error(400, "n and best_of must be 1: each disaggregated request is one room")
        prefill, decode = next(self._next_prefill), next(self._next_decode)
        headers = self._headers(request)
        try:
            if self.sequential:
                kv = await self._prefill(prefill, request.path, body, {"do_remote_decode": True}, headers)
                if not kv:
                    return error(502, f"prefill engine {prefill.url} answered without kv_transfer_params: is it a kv_producer with PdxferConnector?")
                return await self._decode(request, decode, body, kv, headers, started=asyncio.Event())
            return await self._parallel(request, prefill, decode, body, headers)
        except Failed as failed:
            return failed.response

    async def _parallel(self, request: web.Request, prefill: Prefill, decode: str, body: dict, headers: dict) -> web.StreamResponse:
        room = params.new_room()
        started = asyncio.Event()  # the decode's answer began reaching the client
        sizes = self._sizes.get(prefill.url)
        prefilling = asyncio.create_task(self._prefill(prefill, request.path, body, params.for_prefill(room), headers))
        if sizes is None:
            # Until a prefill engine has answered once, the proxy does not know its sizes:
            # its decode request waits for the prefill's answer, which names them.
            await asyncio.wait((prefilling,))
            sizes = self._sizes.get(prefill.url, params.Sizes())
            if prefilling.exception() is not None:
                raise prefilling.exception()
        decoding = asyncio.create_task(self._decode(request, decode, body, params.for_decode(room, prefill.bootstrap, prefill.url, sizes),
                                                    headers, started))
        await asyncio.wait((prefilling, decoding), return_when=asyncio.FIRST_COMPLETED)
        # One engine failed while the other still works on the room: closing the other's
        # request aborts it in vLLM, which aborts the room, rather than leaving it to the
        # daemons' timeouts.
        if prefilling.done() and prefilling.exception() is not None and not started.is_set():
            await self._cancel(decoding)
            raise prefilling.exception()
        if decoding.done() and decoding.exception() is not None and not prefilling.done():
            await self._cancel(prefilling)
        elif not prefilling.done():  # the answer need not wait for the prefill's
            self._background.add(prefilling)
            prefilling.add_done_callback(self._prefill_done)
        else:
            self._prefill_done(prefilling)
        return await decoding

    @staticmethod
    async def _cancel(task: asyncio.Task) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _prefill_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefill request failed after its decode began: %s", task.exception())

    async def _prefill(self, prefill: Prefill, path: str, body: dict, kv: dict, headers: dict) -> dict | None:
        """Run the prompt on the prefill engine; the kv_transfer_params it answered."""
        try:
            async with self._session.post(prefill.url + path, json=prefill_body(path, body, kv), headers=headers) as upstream:
                data = await upstream.read()
                if upstream.status != 200:
                    raise Failed(web.Response(status=upstream.status, body=data, content_type=upstream.content_type))
        except aiohttp.ClientError as exc:
            raise Failed(error(502, f"prefill engine {prefill.url}: {exc}")) from None
        try:
            kv = json.loads(data).get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            raise Failed(error(502, f"prefill engine {prefill.url} answered something other than a JSON object")) from None
        self._learn(prefill, kv)
        return kv

    def _learn(self, prefill: Prefill, kv: dict | None) -> None:
        """The prefill engine's sizes as its answer names them (an engine restarted with
        other sizes is followed)."""
        if not isinstance(kv, dict):
            return
        try:
            sizes = params.sizes_of(kv)
        except ValueError as exc:
            log.warning("prefill engine %s: %s", prefill.url, exc)
            return
        if self._sizes.get(prefill.url) != sizes:
            log.info("prefill engine %s runs TP %d, PP %d", prefill.url, sizes.tp, sizes.pp)
            self._sizes[prefill.url] = sizes

    async def _decode(self, request: web.Request, decode: str, body: dict, kv: dict, headers: dict, started: asyncio.Event) -> web.StreamResponse:
        """The decode engine's answer, relayed as it comes when the client streams."""
        try:
            async with self._session.post(decode + request.path, json={**body, "kv_transfer_params": kv}, headers=headers) as upstream:
                if not body.get("stream") or upstream.status != 200:
                    data = await upstream.read()
                    started.set()
                    return web.Response(status=upstream.status, body=data, content_type=upstream.content_type)
                relay = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.headers.get("Content-Type", "text/event-stream")})
                started.set()
                await relay.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await relay.write(chunk)
                await relay.write_eof()
                return relay
        except aiohttp.ClientError as exc:
            if started.is_set():
                raise  # the client already has part of an answer: cut it
            raise Failed(error(502, f"decode engine {decode}: {exc}")) from None

    @staticmethod
    def _headers(request: web.Request) -> dict[str, str]:
        return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}



async def serve(proxy: Proxy, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, after printing a JSON ready line with the port."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        bound = await proxy.start(host, port)
        ready = {"event": "ready", "url": f"http://{host}:{bound}", "prefills": [p.url for p in proxy.prefills], "decodes": proxy.decodes,
                 "sequential": proxy.sequential}
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
        await stopping.wait()
    finally:
        await proxy.stop()
