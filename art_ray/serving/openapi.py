"""The endpoint's OpenAPI document, served at `/openapi.json`: the routes the gate lets through
(art_ray/serving/endpoint_guard.py), no more. vLLM's app documents far more than art-ray serves, and
art-ray's own routes (capture sessions, feedback, session-scoped completions) are middleware that FastAPI
never sees; so the document is vLLM's for the routes it answers (chat and text completions, Responses,
Messages, models, health), with art-ray's routes added from the pydantic models that validate them, and
every error response in the shape its route answers with (Anthropic's on Messages, OpenAI's elsewhere).

Clients generate from it, and the fuzzer (bench/fuzz.py) takes every request it sends from it.
"""

from __future__ import annotations

import copy
from typing import Any

import pydantic
from pydantic.json_schema import models_json_schema

from art_ray.capture.session_api import OpenSessionRequest, SessionInfo, SessionTurns
from art_ray.feedback import Feedback, FeedbackRecord
from art_ray.serving.endpoint_guard import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    FEEDBACK_PATH,
    HEALTH_PATH,
    MESSAGES_PATH,
    MODELS_PATH,
    RESPONSES_PATH,
    SESSION_ID,
    SESSIONS_PATH,
)

REF = "#/components/schemas/{model}"
OPENAI_ERROR = {"$ref": REF.format(model="ErrorResponse")}
ANTHROPIC_ERROR = {"$ref": REF.format(model="AnthropicErrorResponse")}
# the statuses the gate and the middleware answer before or around vLLM (the gate's 401, 405, 421, 429)
ERROR_STATUSES = {
    "400": "Bad Request",
    "401": "Missing or incorrect API key",
    "404": "Not Found (or another run's model)",
    "405": "Method Not Allowed",
    "421": "Meant for another deployment",
    "429": "Too many requests in flight for the key, or the capture store is full",
}
VLLM_ROUTES = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, MESSAGES_PATH, MODELS_PATH, HEALTH_PATH)
SESSION_PARAMETER = {
    "name": "session_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{SESSION_ID}$"},
}


def endpoint_openapi(vllm_document: dict[str, Any], title: str = "art-ray OpenAI endpoint") -> dict[str, Any]:
    """The endpoint's document, built from vLLM's app's (`app.openapi()`)."""
    document = copy.deepcopy(vllm_document)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    _add_schemas(schemas, [OpenSessionRequest, SessionInfo, SessionTurns, Feedback, FeedbackRecord])
    vllm_paths = document["paths"]
    paths: dict[str, Any] = {}
    for path in VLLM_ROUTES:
        if path in vllm_paths:
            paths[path] = {method: _with_errors(op, path) for method, op in vllm_paths[path].items()}
    for path in (CHAT_PATH, COMPLETIONS_PATH):  # what an agent given `/sessions/{id}/v1` as base URL calls
        if path in paths:
            scoped = {}
            for method, operation in paths[path].items():
                scoped[method] = {
                    **copy.deepcopy(operation),
                    "operationId": f"session_{operation['operationId']}",
                    "parameters": [SESSION_PARAMETER, *operation.get("parameters", [])],
                }
            paths[f"/sessions/{{session_id}}{path}"] = scoped
    opened = _operation(
        "open_capture_session",
        "Open a capture session: its id, and the base URL `/sessions/{id}/v1` for the agent",
        request="OpenSessionRequest",
        response="SessionInfo",
    )
    # what a client does with an opened session's id (Schemathesis follows these in stateful runs)
    session_id = {"session_id": "$response.body#/id"}
    follow = {"ReadSession": "read_capture_session", "CloseSession": "close_capture_session"}
    for path in (CHAT_PATH, COMPLETIONS_PATH):
        for operation in paths.get(f"/sessions/{{session_id}}{path}", {}).values():
            follow[f"Call_{operation['operationId']}"] = operation["operationId"]
    opened["responses"]["200"]["links"] = {
        name: {"operationId": operation_id, "parameters": session_id} for name, operation_id in follow.items()
    }
    paths[SESSIONS_PATH] = {"post": opened}
    model_query = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}
    paths[f"{SESSIONS_PATH}/{{session_id}}"] = {
        method: {
            **_operation(f"{verb}_capture_session", summary, response="SessionTurns"),
            "parameters": [SESSION_PARAMETER, model_query],
        }
        for method, verb, summary in (
            ("get", "read", "The turns a capture session recorded"),
            ("delete", "close", "Close a capture session, answering the turns it dropped"),
        )
    }
    paths[FEEDBACK_PATH] = {
        "post": _operation(
            "post_feedback",
            "Score a served turn, named by completion id, capture session, or the response's token",
            request="Feedback",
            response="FeedbackRecord",
            successes=("200", "202"),  # 202: stored before its turn reached the traffic log
        )
    }
    document["paths"] = paths
    document["info"] = {**document.get("info", {}), "title": title}
    document["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    document["security"] = [{"bearer": []}, {"x-api-key": []}]
    return document


def _add_schemas(schemas: dict[str, Any], models: list[type[pydantic.BaseModel]]) -> None:
    _, generated = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    for name, schema in generated.get("$defs", {}).items():
        if name in schemas and schemas[name] != schema:
            raise ValueError(f"art-ray's schema {name!r} would replace vLLM's of that name")
        schemas[name] = schema


def _errors(path: str) -> dict[str, Any]:
    schema = ANTHROPIC_ERROR if path == MESSAGES_PATH else OPENAI_ERROR
    return {
        status: {"description": text, "content": {"application/json": {"schema": schema}}}
        for status, text in ERROR_STATUSES.items()
    }


def _with_errors(operation: dict[str, Any], path: str) -> dict[str, Any]:
    """vLLM's operation with the error statuses the endpoint answers with: vLLM's 422 never reaches a
    client (vLLM answers a request that fails validation with a 400), and a 5xx is never documented."""
    responses = {
        status: response
        for status, response in operation.get("responses", {}).items()
        if status.startswith("2")
    }
    return {**operation, "responses": {**responses, **_errors(path)}}


def _operation(
    operation_id: str,
    summary: str,
    response: str,
    request: str | None = None,
    successes: tuple[str, ...] = ("200",),
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "responses": {
            **{
                status: {
                    "description": "Successful Response",
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=response)}}},
                }
                for status in successes
            },
            **_errors(""),
        },
    }
    if request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=request)}}},
        }
    return operation
