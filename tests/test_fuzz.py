"""Issue 49, the endpoint fuzzed from its schema: `/openapi.json` documents exactly the routes the gate lets
through, and the bounded form of bench/fuzz.py (Schemathesis, positive and negative requests for every
operation) against the session's app finds no 5xx, no response outside the document, no invalid request
served, no replica restarted, and a normal request is served right after. The long form is the bench."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import fuzz  # noqa: E402

ROUTES = {
    "/v1/chat/completions": {"post"},
    "/v1/completions": {"post"},
    "/v1/responses": {"post"},
    "/v1/messages": {"post"},
    "/v1/models": {"get"},
    "/health": {"get"},
    "/v1/capture/sessions": {"post"},
    "/v1/capture/sessions/{session_id}": {"get", "delete"},
    "/sessions/{session_id}/v1/chat/completions": {"post"},
    "/sessions/{session_id}/v1/completions": {"post"},
    "/v1/feedback": {"post"},
}


def test_the_document_lists_exactly_the_routes_the_gate_serves(inference_app) -> None:  # noqa: ANN001
    url = f"{inference_app.base_url.removesuffix('/v1')}/openapi.json"
    assert httpx.get(url).status_code == 401  # behind the key, as every route
    document = httpx.get(url, headers={"Authorization": f"Bearer {inference_app.api_key}"}).json()
    assert {path: set(methods) for path, methods in document["paths"].items()} == ROUTES
    messages = document["paths"]["/v1/messages"]["post"]["responses"]["400"]
    assert messages["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    opened = document["paths"]["/v1/capture/sessions"]["post"]["responses"]["200"]
    assert opened["links"]["ReadSession"]["operationId"] == "read_capture_session"


SESSION = "fuzz-found-0123456789"
FOUND = [  # what fuzzing found, each answered since as a 400 in OpenAI's error JSON
    ("/v1/completions", b"\x07n\x07\xff"),  # not UTF-8: FastAPI's {"detail": ...} before
    ("/v1/chat/completions", b"\x07n\x07\xff"),
    (f"/sessions/{SESSION}/v1/chat/completions", b'{"model": null, "messages": []}'),  # a 500 before
    (f"/sessions/{SESSION}/v1/completions", b'{"model": null, "prompt": "x"}'),
    (  # vLLM's conversion read `.text` of a refusal part: a 500 before
        "/v1/responses",
        b'{"model": "agent", "input": [{"type": "message", "role": "assistant", "id": "m", "status": '
        b'"completed", "content": [{"type": "refusal", "refusal": "no"}]}]}',
    ),
]


@pytest.mark.parametrize(("path", "body"), FOUND)
def test_what_fuzzing_found_is_a_400_in_openais_shape(inference_app, path: str, body: bytes) -> None:  # noqa: ANN001
    response = httpx.post(
        inference_app.base_url.removesuffix("/v1") + path,
        content=body,
        headers={"Authorization": f"Bearer {inference_app.api_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"], error


@pytest.mark.slow
def test_a_bounded_fuzz_run_finds_nothing_and_restarts_nothing(inference_app) -> None:  # noqa: ANN001
    base_url, key, model = (
        inference_app.base_url.removesuffix("/v1"),
        inference_app.api_key,
        inference_app.model,
    )
    before = fuzz.replica_actors()
    report = fuzz.fuzz_api(base_url, fuzz.bearer(key), model, max_examples=6)
    failures = "\n".join(
        f"{f.kind} {f.operation} {f.status}: {f.message}\n  {f.curl}" for f in report.findings
    )
    assert report.findings == [], failures
    assert len(report.by_operation) == sum(len(methods) for methods in ROUTES.values())
    assert report.requests >= 100
    assert before <= fuzz.replica_actors()  # every replica that served before still does
    assert asyncio.run(fuzz.served_after(base_url, key, model))
