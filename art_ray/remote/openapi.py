"""The training server's OpenAPI document, served at `/openapi.json` behind its key: every route of
art_ray/remote/protocol.py's ROUTES with the pydantic models that validate its body and shape its answer
(each line's, for the NDJSON stream of /train), and every error status the server answers, in its
`{"error": {...}}` shape. FastAPI cannot write it: the handlers read the raw request (to check the key and
the content type before the body) so FastAPI sees no body types. Clients generate from it, and the fuzzer
(bench/fuzz.py) takes every request it sends from it."""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from art_ray.remote.protocol import ROUTES, ErrorBody

REF = "#/components/schemas/{model}"
NDJSON = "application/x-ndjson"
ERROR_STATUSES = {
    "400": "The body is not a valid request, or the backend refused it",
    "401": "Missing or wrong API key",
    "403": "A cross-origin request, or a run key acting for another owner",
    "404": "No such model registered (or another key's)",
    "409": "The model name is taken with another base model or config",
    "413": "The request is larger than the key's quota",
    "415": "The body is not sent as application/json",
    "421": "Meant for another deployment",
    "429": "Too many requests in flight for the key",
}
HEALTH_STATUSES = ("421",)
OPENAPI_STATUSES = ("401", "403", "421")


class ErrorResponse(pydantic.BaseModel):
    error: ErrorBody


def training_openapi(title: str = "art-ray training") -> dict[str, Any]:
    models: list[tuple[type[pydantic.BaseModel], JsonSchemaMode]] = [(ErrorResponse, "serialization")]
    for route in ROUTES.values():
        models += [(route.request, "validation"), (route.response, "serialization")]
    refs, generated = models_json_schema(models, ref_template=REF)
    paths: dict[str, Any] = {}
    for path, route in ROUTES.items():
        answer = refs[(route.response, "serialization")]
        paths[path] = {
            "post": {
                "operationId": path.strip("/"),
                "summary": route.summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(route.request, "validation")]}},
                },
                "responses": {
                    "200": {
                        "description": "each line one JSON object of this schema" if route.stream else "OK",
                        "content": {NDJSON if route.stream else "application/json": {"schema": answer}},
                    },
                    **_errors(ERROR_STATUSES),
                },
            }
        }
    # what a client does with a model it registered (Schemathesis follows these in stateful runs)
    registered = {"model": "$request.body#/name"}
    paths["/register"]["post"]["responses"]["200"]["links"] = {
        f"Then_{path.strip('/')}": {"operationId": path.strip("/"), "requestBody": registered}
        for path in ("/step", "/traffic", "/release", "/log", "/train")
    }
    models_answer = {
        "type": "object",
        "properties": {"models": {"type": "array", "items": {"type": "string"}}},
        "required": ["models"],
    }
    paths["/health"] = {
        "get": {
            "operationId": "health",
            "summary": "The models registered through this server",
            "security": [],
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": models_answer}}},
                **_errors(HEALTH_STATUSES),
            },
        }
    }
    paths["/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors(OPENAPI_STATUSES),
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": generated.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _errors(statuses: dict[str, str] | tuple[str, ...]) -> dict[str, Any]:
    schema = {"$ref": REF.format(model="ErrorResponse")}
    return {
        status: {"description": ERROR_STATUSES[status], "content": {"application/json": {"schema": schema}}}
        for status in statuses
    }
