"""pdxfer proxy (pdxfer.adapters.vllm.proxy, routing; docs/engines.md §C2) between fake vLLM
engines: aiohttp servers that record what they are sent and answer as vLLM does. The real
engines' acceptance test is tests/engines/test_vllm_engines.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from pdxfer.adapters.vllm import params
from pdxfer.adapters.vllm.routing import Prefill, Proxy

BOOTSTRAP = "10.0.0.1:18998"


class FakeEngine:
    """An OpenAI endpoint that records each request body and answers with ``answer(body)``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.bodies: list[dict] = []
        self.arrived = asyncio.Event()
        self.closed_early = asyncio.Event()  # a request was closed before its answer
        self.url = ""

    async def start(self) -> "FakeEngine":
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def _health(self, request: web.Request):
        return web.Response(status=200)

    async def _models(self, request: web.Request):
        return web.json_response({"data": [{"id": "tiny"}]})

    async def _handle(self, request: web.Request):
        body = await request.json()
        self.bodies.append({"path": request.path, **body})
        self.arrived.set()
        try:
            return await self.answer(request, body)
        except asyncio.CancelledError:
            self.closed_early.set()
            raise


async def completion(request, body, text="decoded"):
    return web.json_response({"choices": [{"text": text}], "kv_transfer_params": None})


@pytest.fixture
async def proxied():
    """start(prefill_answer, decode_answer, sequential) -> (proxy url, prefill, decode)."""
    made = []

    async def start(prefill_answer, decode_answer, sequential=False):
        prefill, decode = await FakeEngine(prefill_answer).start(), await FakeEngine(decode_answer).start()
        proxy = Proxy([Prefill(prefill.url, None if sequential else BOOTSTRAP)], [decode.url], sequential)
        port = await proxy.start("127.0.0.1", 0)
        made.extend([prefill.runner, decode.runner, proxy])
        return f"http://127.0.0.1:{port}", prefill, decode

    yield start
    for thing in made:
        await (thing.stop() if isinstance(thing, Proxy) else thing.cleanup())


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json()


async def until(condition, timeout: float = 10.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


async def test_c2_both_engines_get_the_prompt_at_once_with_one_room_once_the_prefills_sizes_are_known(proxied):
    """The first request's decode is asked once the prefill answered: the answer names
    the prefill engine's TP and PP sizes, which the decode's daemon needs. From then on
    each fake engine answers only once the other has the request: a proxy that waited
    for the prefill before calling the decode would never finish."""
    engines = {}
    prefill_sizes = params.Sizes(tp=2, pp=1)

    async def prefill_answer(request, body):
        prefill, decode = engines["prefill"], engines["decode"]
        if len(prefill.bodies) > 1:
            await until(lambda: len(decode.bodies) == len(prefill.bodies))
        return web.json_response({"choices": [{"text": "x"}],
                                  "kv_transfer_params": params.answer(body["kv_transfer_params"]["room"], None, "p", prefill_sizes)})

    answered = []

    async def decode_answer(request, body):
        await until(lambda: len(engines["prefill"].bodies) == len(engines["decode"].bodies))
        answered.append(len(engines["prefill"].bodies))
        return await completion(request, body)

    url, engines["prefill"], engines["decode"] = await proxied(prefill_answer, decode_answer)
    request = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 16, "min_tokens": 4, "ignore_eos": True, "temperature": 0}
    for _ in range(2):
        status, answer = await post(url, "/v1/completions", request)
        assert status == 200 and answer["choices"][0]["text"] == "decoded"
    assert answered == [1, 2]

    for to_prefill, to_decode in zip(engines["prefill"].bodies, engines["decode"].bodies, strict=True):
        room = to_prefill["kv_transfer_params"]["room"]
        assert to_prefill == {"path": "/v1/completions", "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "stream": False,
                              "ignore_eos": True, "temperature": 0, "kv_transfer_params": params.for_prefill(room)}
        assert to_decode == {"path": "/v1/completions", **request,
                             "kv_transfer_params": params.for_decode(room, BOOTSTRAP, engines["prefill"].url, prefill_sizes)}


async def test_c2_chat_caps_the_prefill_at_one_token_and_streams_the_decode_as_it_comes(proxied):
    first_read = asyncio.Event()

    async def decode_answer(request, body):
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        await asyncio.wait_for(first_read.wait(), 10)  # the client saw the first event before the last was written
        await stream.write(b'data: {"choices": [{"delta": {"content": "b"}}]}\n\ndata: [DONE]\n\n')
        return stream

    url, prefill, decode = await proxied(completion, decode_answer)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/chat/completions", json=chat) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        first = await response.content.readuntil(b"\n\n")
        first_read.set()
        rest = await response.content.read()
    assert b'"a"' in first and rest.endswith(b"data: [DONE]\n\n") and b'"b"' in rest
    (to_prefill,) = prefill.bodies
    assert to_prefill["max_completion_tokens"] == to_prefill["max_tokens"] == 1
    assert to_prefill["stream"] is False and "stream_options" not in to_prefill
    assert decode.bodies[0]["stream"] is True and decode.bodies[0]["max_completion_tokens"] == 9


async def test_c2_sequential_forwards_what_the_prefill_answered(proxied):
    answered = params.answer(77, BOOTSTRAP, "prefill-engine", params.Sizes(tp=2))

    async def prefill_answer(request, body):
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {**answered, "remote_prefill_cached_tokens": 0}})

    async def decode_answer(request, body):
        assert prefill.bodies, "the decode was asked before the prefill"
        return await completion(request, body)

    url, prefill, decode = await proxied(prefill_answer, decode_answer, sequential=True)
    status, _ = await post(url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert status == 200
    assert prefill.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}  # no room: the prefill picks it
    assert params.read(decode.bodies[0]["kv_transfer_params"]) == params.read(answered)


def first_answers(then):
    """An engine's answer: as vLLM's to the first request (a prefill's names its sizes),
    then ``then``'s. The first teaches the proxy the prefill's sizes: the requests that
    follow go to both engines at once."""

    calls = []

    async def answer(request, body):
        calls.append(body)
        if len(calls) > 1:
            return await then(request, body)
        if body["kv_transfer_params"].get("do_remote_decode"):
            kv = params.answer(body["kv_transfer_params"]["room"], None, "p", params.Sizes())
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": kv})
        return await completion(request, body)

    return answer


async def test_c2_a_prefill_refusal_ends_the_request_and_closes_the_decodes(proxied):
    async def refuse(request, body):
        await asyncio.wait_for(decode.arrived.wait(), 10)
        return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)

    async def never(request, body):
        await asyncio.sleep(60)

    url, prefill, decode = await proxied(first_answers(refuse), first_answers(never))
    assert (await post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}))[0] == 200
    decode.arrived.clear()
    status, answer = await asyncio.wait_for(post(url, "/v1/completions", {"model": "tiny", "prompt": "x" * 10, "max_tokens": 4}), 20)
    assert (status, answer["error"]["message"]) == (400, "prompt too long")
    await asyncio.wait_for(decode.closed_early.wait(), 10)  # vLLM aborts a request whose connection closed


async def test_c2_a_first_prefill_refusal_ends_the_request_before_the_decode_is_asked(proxied):
    """Until the prefill's sizes are known the decode waits for its answer: a refusal
    then is the client's answer, and the decode never hears of the room."""

    async def refuse(request, body):
        return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)

    url, prefill, decode = await proxied(refuse, completion)
    status, answer = await asyncio.wait_for(post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}), 20)
    assert (status, answer["error"]["message"]) == (400, "prompt too long")
    assert len(prefill.bodies) == 1 and decode.bodies == []


async def test_c2_an_unreachable_decode_closes_the_prefills_request(proxied):
    async def hold(request, body):
        await asyncio.sleep(60)

    url, prefill, decode = await proxied(first_answers(hold), completion)
    assert (await post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}))[0] == 200
    await decode.runner.cleanup()
    status, answer = await asyncio.wait_for(post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}), 20)
    assert status == 502 and answer["error"]["message"].startswith(f"decode engine {decode.url}")
    await asyncio.wait_for(prefill.closed_early.wait(), 10)


async def test_c2_refusals_the_proxy_makes_itself(proxied):
    url, prefill, decode = await proxied(completion, completion)
    assert (await post(url, "/v1/completions", {"prompt": "x", "n": 2}))[0] == 400
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400 and "not JSON" in (await response.json())["error"]["message"]
        async with session.get(url + "/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == "tiny"
    assert prefill.bodies == decode.bodies == []


async def test_health_is_200_only_while_a_prefill_and_a_decode_engine_answer_theirs(proxied):
    """A router's readiness: it used to answer 200 with both engines down."""
    url, prefill, decode = await proxied(completion, completion)

    async def health() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as response:
            return response.status, await response.json()

    assert await health() == (200, {"prefills": {prefill.url: "ok"}, "decodes": {decode.url: "ok"}, "sequential": False})
    await decode.runner.cleanup()
    status, answer = await health()
    assert status == 503 and answer["prefills"] == {prefill.url: "ok"}, answer
    assert answer["decodes"][decode.url].startswith("unreachable: "), answer
    await prefill.runner.cleanup()
    status, answer = await health()
    assert status == 503 and answer["prefills"][prefill.url].startswith("unreachable: "), answer


def test_c2_pdxfer_proxy_serves_after_its_ready_line_and_checks_its_flags():
    bad = subprocess.run([sys.executable, "-m", "pdxfer", "proxy", "--prefill", "http://a", "--decode", "http://b"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--bootstrap" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "pdxfer", "proxy", "--prefill", "http://127.0.0.1:9", "--bootstrap", BOOTSTRAP,
                             "--decode", "http://127.0.0.1:9", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["prefills"] == ready["decodes"] == ["http://127.0.0.1:9"]

        async def ask():
            async with aiohttp.ClientSession() as session, session.post(ready["url"] + "/v1/completions", json={"prompt": "x"}) as response:
                return response.status, await response.json()

        status, answer = asyncio.run(ask())
        assert status == 502 and "engine http://127.0.0.1:9" in answer["error"]["message"]  # nothing listens there
    finally:
        proc.terminate()
    assert proc.wait(timeout=30) == 0
