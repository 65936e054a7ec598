"""The endpoint is closed and fair by default: only documented routes, all behind the key, a cap on `n`, a
bounded default `max_tokens`, and a client that goes away stops its generation (issue 17)."""

from __future__ import annotations

import asyncio
import time

import fastapi
import httpx
import openai
import pytest
from ray import serve
from vllm.entrypoints.serve.utils.api_utils import with_cancellation

from art_ray.adapters.registry import INFERENCE_DEPLOYMENT
from art_ray.serving.disconnect import DisconnectOnCancel
from art_ray.serving.endpoint_guard import EndpointGuard

PROMPT = [{"role": "user", "content": "Tell me a long story."}]


async def call(app, method: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.request(method, path, headers=headers or {})
    return response.status_code, response.json()


async def ok_app(scope, receive, send) -> None:  # noqa: ANN001
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def test_the_gate_lets_only_documented_routes_through_with_the_key() -> None:
    guard = EndpointGuard(ok_app, api_key="k")
    key = {"Authorization": "Bearer k"}
    assert await call(guard, "POST", "/v1/chat/completions", key) == (200, {})
    assert (await call(guard, "GET", "/health", key))[0] == 200
    for path in ("/v1/responses", "/v1/messages", "/sessions/s0123456789abcdef/v1/messages"):
        assert await call(guard, "POST", path, key) == (200, {})
    assert await call(guard, "POST", "/v1/messages", {"x-api-key": "k"}) == (200, {})  # Anthropic clients
    for path in ("/invocations", "/tokenize", "/metrics", "/docs", "/v1/messages/count_tokens"):
        status, body = await call(guard, "POST", path, key)
        assert status == 404 and body["error"]["type"] == "NotFoundError", path
    status, body = await call(guard, "POST", "/v1/messages", {"x-api-key": "wrong"})  # Anthropic's shape
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, body = await call(guard, "GET", "/v1/chat/completions", key)
    assert status == 405 and body["error"]["code"] == 405
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}):
        status, body = await call(guard, "GET", "/health", headers)
        assert status == 401 and body["error"]["type"] == "AuthenticationError"
    assert (await call(guard, "OPTIONS", "/v1/models"))[0] == 200  # a CORS preflight carries no key
    assert (await call(EndpointGuard(ok_app, api_key=None), "GET", "/v1/models"))[0] == 200


async def test_a_cancelled_request_cancels_vllms_route_task() -> None:
    """Serve cancels the request's task when its client leaves; vLLM's route (`with_cancellation`) keeps
    its own task running unless it is told of a disconnect."""
    started, cancelled = asyncio.Event(), asyncio.Event()
    app = fastapi.FastAPI()

    async def generate() -> dict:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(raw_request: fastapi.Request) -> dict:
        return await generate()

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "root_path": "",
        "headers": [],
        "query_string": b"",
        "app": app,
    }
    first = True

    async def receive_once_then_wait() -> dict:
        nonlocal first
        if first:
            first = False
            return await receive()
        await asyncio.Event().wait()  # the client is still there as far as the replica can tell
        return {}

    request = asyncio.ensure_future(DisconnectOnCancel(app)(scope, receive_once_then_wait, send))
    await asyncio.wait_for(started.wait(), 10)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.wait_for(cancelled.wait(), 2)
    assert sent == []  # nothing is sent to a client that left


def headers(app) -> dict:
    return {"Authorization": f"Bearer {app.api_key}"}


@pytest.mark.slow
def test_only_documented_routes_answer_and_all_need_the_key(inference_app) -> None:
    root = inference_app.base_url.removesuffix("/v1")
    for method, path in [
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("POST", "/scale_elastic_ep"),
    ]:
        for auth in ({}, headers(inference_app)):
            response = httpx.request(method, root + path, headers=auth, json={"model": "x", "input": "hi"})
            assert response.status_code == 404, (path, response.text)
            assert response.json()["error"]["type"] == "NotFoundError"
    unauthorized = httpx.get(root + "/health")
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == 401
    assert httpx.get(root + "/health", headers=headers(inference_app)).status_code == 200
    bad_key = httpx.post(f"{root}/v1/chat/completions", headers={"Authorization": "Bearer no"}, content=b"{x")
    assert bad_key.status_code == 401 and bad_key.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.slow
def test_n_is_capped_and_max_tokens_has_a_bounded_default(inference_app) -> None:
    client = openai.OpenAI(base_url=inference_app.base_url, api_key=inference_app.api_key, max_retries=0)
    for n in (0, 129, 10000):
        with pytest.raises(openai.BadRequestError) as rejected:
            client.chat.completions.create(model=inference_app.model, messages=PROMPT, n=n, max_tokens=1)
        assert rejected.value.body["param"] == "n"
    assert (
        len(client.completions.create(model=inference_app.model, prompt="a", n=128, max_tokens=1).choices)
        == 128
    )
    # no max_tokens: the app's default (48 in the session app) bounds the reply, not the 512-token context
    unbounded = client.chat.completions.create(
        model=inference_app.model, messages=PROMPT, extra_body={"ignore_eos": True}
    )
    assert unbounded.usage.completion_tokens == 48
    # only a default: a request that names a larger limit gets it, whichever field names it
    for limit in ({"max_tokens": 100}, {"max_completion_tokens": 100}):
        longer = client.chat.completions.create(
            model=inference_app.model, messages=PROMPT, extra_body={"ignore_eos": True}, **limit
        )
        assert longer.usage.completion_tokens == 100, limit


async def unfinished(app) -> int:
    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, app.app_name)
    return sum(await handle.broadcast("unfinished_requests").results_async(timeout_s=60))


async def wait_until_idle(app, within_s: float) -> float:
    start = time.monotonic()
    while (left := await unfinished(app)) > 0:
        assert time.monotonic() - start < within_s, f"{left} abandoned requests still generating"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


def long_request(app, client: openai.AsyncOpenAI, stream: bool = False):  # noqa: ANN201
    # 64 sequences (an engine's whole batch, EngineConfig.max_num_seqs) x 480 tokens: even a request that has
    # its replica to itself needs 480 decode steps of a full batch, ~20 s for the tiny model on one thread
    # (45 ms a step here), far beyond the 1.5 s client timeout and the few seconds an abort may take. (Until
    # the endpoint's default max_tokens stopped capping requests, these were cut to 48 tokens, and one
    # request of 16 sequences finished before its timeout in a CI run.)
    return client.chat.completions.create(
        model=app.model, messages=PROMPT, n=64, max_tokens=480, stream=stream, extra_body={"ignore_eos": True}
    )


async def until_generating(app) -> None:
    deadline = time.monotonic() + 30
    while await unfinished(app) == 0:
        assert time.monotonic() < deadline, "the requests never reached the engines"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_abandoned_requests_stop_generating(inference_app) -> None:
    # the OpenAI client's timeout
    async with openai.AsyncOpenAI(
        base_url=inference_app.base_url, api_key=inference_app.api_key, max_retries=0, timeout=1.5
    ) as client:
        requests = asyncio.gather(
            *(long_request(inference_app, client) for _ in range(16)), return_exceptions=True
        )
        await until_generating(inference_app)
        results = await requests
    assert all(isinstance(result, openai.APITimeoutError) for result in results), results
    await wait_until_idle(inference_app, within_s=5)

    # a cancelled gather, streaming and not
    async with openai.AsyncOpenAI(
        base_url=inference_app.base_url, api_key=inference_app.api_key, max_retries=0
    ) as client:

        async def read_stream() -> None:
            async for _ in await long_request(inference_app, client, stream=True):
                pass

        tasks = [asyncio.ensure_future(long_request(inference_app, client)) for _ in range(8)]
        tasks += [asyncio.ensure_future(read_stream()) for _ in range(8)]
        await until_generating(inference_app)
        await asyncio.sleep(0.5)
        gathered = asyncio.gather(*tasks)
        gathered.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gathered
        await wait_until_idle(inference_app, within_s=5)
        # and the endpoint answers at once afterwards
        reply = await client.chat.completions.create(model=inference_app.model, messages=PROMPT, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
