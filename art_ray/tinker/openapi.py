"""The Tinker API's OpenAPI document, served at `/openapi.json` behind its key. Tinker publishes none;
this one is FastAPI's, from the request bodies the routes validate (art_ray/tinker/bodies.py), completed
with what FastAPI cannot see: each route's answer as the official SDK's type, forward_backward's protobuf
body, the key as a security scheme rather than a header parameter, and every error status in FastAPI's
`{"detail": ...}` shape (which the SDK reads). The catch-all route that answers unserved paths with a 404
is not in it. The fuzzer (bench/fuzz.py) takes every request it sends from it."""

from __future__ import annotations

import copy
from typing import Any

import pydantic
from pydantic.json_schema import models_json_schema
from tinker import types as sdk

REF = "#/components/schemas/{model}"
PROTOBUF = "application/x-protobuf"
API_KEY_HEADER = "x-api-key"


class Detail(pydantic.BaseModel):
    """FastAPI's error body: a message, or its validation errors."""

    detail: str | list[dict[str, Any]]


# each route's answer when it succeeds: a future (its result comes from /retrieve_future), or the SDK type
FUTURE = sdk.UntypedAPIFuture
ANSWERS: dict[str, type[pydantic.BaseModel] | None] = {
    "/client/config": sdk.ClientConfigResponse,
    "/client/dynamic_config": sdk.ClientDynamicConfigResponse,
    "/healthz": sdk.HealthResponse,
    "/get_server_capabilities": sdk.GetServerCapabilitiesResponse,
    "/telemetry": sdk.TelemetryResponse,
    "/create_session": sdk.CreateSessionResponse,
    "/session_heartbeat": sdk.SessionHeartbeatResponse,
    "/sessions/{session_id}/finish": None,
    "/create_model": FUTURE,
    "/get_info": sdk.GetInfoResponse,
    "/unload_model": FUTURE,
    "/forward_backward": FUTURE,
    "/optim_step": FUTURE,
    "/save_weights_for_sampler": FUTURE,
    "/save_weights": FUTURE,
    "/load_weights": FUTURE,
    "/save_weights_external": FUTURE,
    "/create_sampling_session": sdk.CreateSamplingSessionResponse,
    "/samplers/{sampler_id}": sdk.GetSamplerResponse,
    "/asample": FUTURE,
    "/retrieve_future": None,  # the verb's JSON result, a try-again, a failure, or protobuf (Accept)
    "/training_runs": sdk.TrainingRunsResponse,
    "/training_runs/{model_id}": sdk.TrainingRun,
    "/training_runs/{model_id}/checkpoints": sdk.CheckpointsListResponse,
}
ERROR_STATUSES = {
    "401": "Missing or unknown API key",
    "404": "No such session, model, sampler, checkpoint or future (or another key's)",
    "422": "The body is not a valid request (not JSON, not UTF-8, or not the route's body)",
    "429": "Too many requests in flight for the key",
}
EXTRA_STATUSES = {
    "/retrieve_future": {"406": "The result is protobuf: send Accept: application/x-protobuf"},
    "/session_heartbeat": {"410": "The session has ended"},
}
UNAUTHENTICATED = ("/healthz",)
OPERATION_IDS = {
    "/sessions/{session_id}/finish": "finish_session",
    "/samplers/{sampler_id}": "get_sampler",
    "/training_runs/{model_id}": "get_training_run",
    "/training_runs/{model_id}/checkpoints": "list_checkpoints",
}


def _links(served_base_models: list[str]) -> dict[str, dict[str, Any]]:
    """What a client does with what a route answered (Schemathesis follows these in stateful runs): a
    session's id into the routes that take one, a sampler's into /asample, a future's into
    /retrieve_future. A sampling session names a served base model so its samples are real."""
    session = {"session_id": "$response.body#/session_id"}
    future = {
        "RetrieveFuture": {
            "operationId": "retrieve_future",
            "requestBody": {"request_id": "$response.body#/request_id"},
        }
    }
    served = served_base_models[0] if served_base_models else None
    return {
        "create_session": {
            "Heartbeat": {"operationId": "session_heartbeat", "requestBody": session},
            "CreateModel": {"operationId": "create_model", "requestBody": session},
            "CreateSampler": {
                "operationId": "create_sampling_session",
                "requestBody": {**session, "base_model": served, "model_path": None},
            },
            "Finish": {
                "operationId": "finish_session",
                "parameters": {"path.session_id": "$response.body#/session_id"},
            },
        },
        "create_sampling_session": {
            "Sample": {
                "operationId": "asample",
                "requestBody": {"sampling_session_id": "$response.body#/sampling_session_id"},
            },
            "ReadSampler": {
                "operationId": "get_sampler",
                "parameters": {"path.sampler_id": "$response.body#/sampling_session_id"},
            },
        },
        "create_model": {
            **future,
            "GetInfo": {"operationId": "get_info", "requestBody": {"model_id": "$response.body#/model_id"}},
        },
        "asample": future,
    }


def tinker_openapi(
    fastapi_document: dict[str, Any], served_base_models: list[str], title: str = "art-ray Tinker API"
) -> dict[str, Any]:
    """The document, from the Tinker app's own (`app.openapi()`)."""
    document = copy.deepcopy(fastapi_document)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    answers = [model for model in ANSWERS.values() if model is not None]
    refs, generated = models_json_schema(
        [(model, "serialization") for model in [*answers, Detail]], ref_template=REF
    )
    for name, schema in generated.get("$defs", {}).items():
        if name in schemas and schemas[name] != schema:
            raise ValueError(f"the SDK's schema {name!r} would replace a request body's of that name")
        schemas[name] = schema
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    links = _links(served_base_models)
    paths: dict[str, Any] = {}
    for path, operations in document["paths"].items():
        if path not in ANSWERS:  # the catch-all 404 and this document's own route
            continue
        answer = ANSWERS[path]
        paths[path] = {}
        for method, operation in operations.items():
            parameters = [
                parameter
                for parameter in operation.get("parameters", [])
                if not (parameter["in"] == "header" and parameter["name"].lower() == API_KEY_HEADER)
            ]
            ok_schema = refs[(answer, "serialization")] if answer is not None else {"type": "object"}
            content: dict[str, Any] = {"application/json": {"schema": ok_schema}}
            if path == "/retrieve_future":
                content[PROTOBUF] = {"schema": {"type": "string", "format": "binary"}}
            errors = {} if path in UNAUTHENTICATED else {**ERROR_STATUSES, **EXTRA_STATUSES.get(path, {})}
            detail = refs[(Detail, "serialization")]
            operation = {
                **operation,
                "parameters": parameters,
                "responses": {
                    "200": {"description": "OK", "content": content},
                    **{
                        status: {"description": text, "content": {"application/json": {"schema": detail}}}
                        for status, text in errors.items()
                    },
                },
            }
            if not parameters:
                del operation["parameters"]
            if path == "/forward_backward":  # forward() too; the SDK sends the batch as protobuf
                operation["requestBody"] = {
                    "required": True,
                    "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
                }
            if path in UNAUTHENTICATED:
                operation["security"] = []
            operation["operationId"] = OPERATION_IDS.get(path, path.strip("/").replace("/", "_"))
            if operation["operationId"] in links:
                operation["responses"]["200"]["links"] = links[operation["operationId"]]
            paths[path][method] = operation
    document["paths"] = paths
    document["info"] = {**document.get("info", {}), "title": title}
    document["components"]["securitySchemes"] = {
        "x-api-key": {"type": "apiKey", "in": "header", "name": "X-API-Key"}
    }
    document["security"] = [{"x-api-key": []}]
    return document
