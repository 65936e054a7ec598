"""Run keys on a shared endpoint (issue 27): a run key sees its own runs and nothing else, the admin key
sees all, and a key's concurrent requests are capped. The gate and the middlewares in front of vLLM,
around a stand-in for vLLM's app; the whole path through real replicas is in test_sdk."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest
import ray

from art_ray.access import AccessError, AccessTable, KeyGrant, key_digest
from art_ray.serving.asgi import caller_of
from art_ray.serving.capture import CaptureMiddleware
from art_ray.serving.endpoint_guard import EndpointGuard
from art_ray.serving.middleware import ModelRoutingMiddleware

ADMIN, ALICE, BOB = "admin-key", "art-alice", "art-bob"


def table() -> AccessTable:
    access = AccessTable().with_key(key_digest(ALICE), KeyGrant(name="alice", max_concurrent_requests=1))
    access = access.with_key(key_digest(BOB), KeyGrant(name="bob"))
    return access.with_owner("run-a", "alice").with_owner("run-b", "bob")


def test_the_table_grants_keys_by_digest_and_runs_by_owner() -> None:
    access = table()
    alice, bob = access.grant_for(ALICE), access.grant_for(BOB)
    assert alice is not None and alice.name == "alice" and bob is not None
    assert access.grant_for("art-nobody") is None and access.grant_for(None) is None
    assert ALICE not in access.model_dump_json()  # only digests are kept
    assert access.sees(alice, "run-a") and not access.sees(alice, "run-b") and not access.sees(bob, "run-a")
    assert not access.sees(alice, "admin-run") and access.sees(None, "run-b")
    with pytest.raises(AccessError, match="named 'alice'"):
        access.with_key(key_digest("art-other"), KeyGrant(name="alice"))
    with pytest.raises(AccessError):
        access.without_key("carol")
    revoked = access.without_key("alice")
    assert revoked.grant_for(ALICE) is None and revoked.owners["run-a"] == "alice"
    assert revoked.version > access.version
    assert "run-a" not in revoked.with_owner("run-a", None).owners


class Versions:
    """The replica's adapter store, for the middleware: two runs, each at step 1."""

    def latest_step(self, model: str) -> int | None:
        return 1 if model in ("run-a", "run-b", "admin-run") else None

    def served_models(self) -> dict[str, list[int]]:
        return {"run-a": [1], "run-b": [1], "admin-run": [1]}

    async def ensure(self, model: str, step: int) -> bool:
        return True


async def vllm_stand_in(scope, receive, send) -> None:  # noqa: ANN001
    """Answers a generation with the model it was asked for, the model list with every version, and
    waits on `release` while a request names the model `slow`."""
    if scope["path"] == "/v1/models":
        body = {"object": "list", "data": [{"id": f"{m}@1"} for m in ("run-a", "run-b", "admin-run")]}
    else:
        request = json.loads((await receive())["body"])
        if request["model"].startswith("run-a") and scope.get("slow"):
            await scope["slow"].wait()
        body = {"model": request["model"], "choices": []}
    payload = json.dumps(body).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": payload})


class NoStore:
    def __call__(self) -> None:
        raise AssertionError("the capture store was asked for a session of a model the caller cannot see")


def endpoint(access: AccessTable, slow: asyncio.Event | None = None):  # noqa: ANN201
    routed = ModelRoutingMiddleware(vllm_stand_in, Versions(), max_n=4, default_max_tokens=16)

    async def inner(scope, receive, send) -> None:  # noqa: ANN001
        assert caller_of(scope) is not None
        await routed({**scope, "slow": slow} if slow else scope, receive, send)

    return EndpointGuard(CaptureMiddleware(inner, store=NoStore()), api_key=ADMIN, access=lambda: access)


async def request(app, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:  # noqa: ANN001
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
    return response.status_code, response.json()


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_run_key_samples_its_own_runs_and_not_anothers() -> None:
    app = endpoint(table())
    for model in ("run-a", "run-a@1"):
        status, body = await request(app, "POST", "/v1/chat/completions", ALICE, chat(model))
        assert status == 200 and body["model"] == "run-a@1"
    unknown = await request(app, "POST", "/v1/chat/completions", ALICE, chat("no-such-run"))
    for model in ("run-b", "run-b@1", "admin-run"):
        status, body = await request(app, "POST", "/v1/chat/completions", ALICE, chat(model))
        # as if it did not exist: the same answer as a name nobody registered
        assert status == 404 == unknown[0], model
        assert body["error"]["type"] == unknown[1]["error"]["type"] == "NotFoundError"
        assert body["error"]["message"] == f"The model `{model}` does not exist."
    status, body = await request(app, "GET", "/v1/models", ALICE)
    assert status == 200 and sorted(card["id"] for card in body["data"]) == ["run-a", "run-a@1"]
    status, body = await request(app, "GET", "/v1/models", ADMIN)
    assert {card["id"] for card in body["data"]} >= {"run-a", "run-b", "admin-run"}
    assert (await request(app, "POST", "/v1/chat/completions", ADMIN, chat("run-b")))[0] == 200
    status, body = await request(app, "POST", "/v1/capture/sessions", ALICE, {"model": "run-b"})
    assert status == 404 and body["error"]["param"] == "model"
    assert (await request(app, "GET", "/v1/models", "art-revoked"))[0] == 401


async def test_a_run_keys_concurrent_requests_are_capped() -> None:
    release = asyncio.Event()
    app = endpoint(table(), slow=release)
    first = asyncio.create_task(request(app, "POST", "/v1/chat/completions", ALICE, chat("run-a")))
    await asyncio.sleep(0.2)
    assert not first.done()
    status, body = await request(app, "POST", "/v1/chat/completions", ALICE, chat("run-a"))
    assert (
        status == 429 and body["error"]["type"] == "RateLimitError" and "'alice'" in body["error"]["message"]
    )
    # another key and the admin key are not held back by alice's
    assert (await request(app, "POST", "/v1/chat/completions", BOB, chat("run-b")))[0] == 200
    release.set()
    assert (await first)[0] == 200
    assert (await request(app, "POST", "/v1/chat/completions", ALICE, chat("run-a")))[0] == 200


async def test_the_training_servers_cap_counts_a_request_until_its_response_is_sent(
    tmp_path, monkeypatch
) -> None:
    """The same cap on the training server (art_ray/remote/server.py): a key's request counts until its
    response is sent, streams included (their BackgroundTask), and other keys are not held back."""
    from fastapi.responses import JSONResponse
    from starlette.applications import Starlette
    from starlette.routing import Route

    from art_ray.remote import server as training_server
    from art_ray.remote.protocol import ModelRef

    # the deployment's own class, under the ASGI wrapper serve.ingress puts around it; its keys are this
    # test's table (the server reads the cluster's, from the registry)
    deployment_class = training_server.TrainingServer.func_or_class.__mro__[1]

    async def authorize(self, http_request) -> KeyGrant | None:  # noqa: ANN001
        return table().grant_for(http_request.headers["authorization"].removeprefix("Bearer "))

    monkeypatch.setattr(deployment_class, "_authorize", authorize)
    server = deployment_class({"storage": str(tmp_path), "api_key": ADMIN})
    release = asyncio.Event()

    async def step(http_request):  # noqa: ANN001, ANN202
        async def handle(body: ModelRef, grant: KeyGrant | None) -> JSONResponse:
            if body.model == "slow":
                await release.wait()
            return JSONResponse({"step": 0})

        return await server._call(http_request, ModelRef, handle)

    app = Starlette(routes=[Route("/step", step, methods=["POST"])])
    first = asyncio.create_task(request(app, "POST", "/step", ALICE, {"model": "slow"}))
    await asyncio.sleep(0.2)
    assert not first.done()
    status, body = await request(app, "POST", "/step", ALICE, {"model": "run-a"})
    assert (
        status == 429
        and body["error"]["type"] == "rate_limit_error"
        and "'alice'" in body["error"]["message"]
    )
    assert (await request(app, "POST", "/step", BOB, {"model": "run-b"}))[0] == 200
    assert (await request(app, "POST", "/step", ADMIN, {"model": "run-b"}))[0] == 200
    release.set()
    assert (await first)[0] == 200
    assert (await request(app, "POST", "/step", ALICE, {"model": "run-a"}))[0] == 200
    assert server.in_flight["alice"] == 0


class RestartingStore:
    """A capture store that Ray is restarting: every call fails as a call to an unavailable actor does."""

    def __getattr__(self, method: str):  # noqa: ANN204
        async def remote(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
            raise ray.exceptions.ActorUnavailableError("The actor is restarting.", None)

        return types.SimpleNamespace(remote=remote)


async def test_a_capture_store_that_restarts_is_a_503_to_retry_not_a_500() -> None:
    """Found by the soak: a capture session's request while the store restarted was a 500."""
    routed = ModelRoutingMiddleware(vllm_stand_in, Versions(), max_n=4, default_max_tokens=16)
    app = EndpointGuard(
        CaptureMiddleware(routed, store=RestartingStore), api_key=ADMIN, access=lambda: table()
    )
    status, body = await request(app, "POST", "/v1/capture/sessions", ALICE, {"model": "run-a"})
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError", body
    session = "s" * 16
    path = f"/sessions/{session}/v1/chat/completions"
    status, body = await request(app, "POST", path, ALICE, chat("run-a"))
    assert status == 503 and "restarting" in body["error"]["message"], body


async def test_a_null_answer_of_a_cancelled_request_passes_through_unannotated() -> None:
    """vLLM answers a request whose client went away with a JSON `null`; the endpoint annotated choices
    of it and raised an AttributeError per cancelled request (found by the soak's flood)."""

    async def cancelled(scope, receive, send) -> None:  # noqa: ANN001
        await receive()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"null"})

    app = EndpointGuard(
        ModelRoutingMiddleware(cancelled, Versions(), max_n=4, default_max_tokens=16),
        api_key=ADMIN,
        access=lambda: table(),
    )
    status, body = await request(app, "POST", "/v1/chat/completions", ADMIN, chat("run-a"))
    assert (status, body) == (200, None)
