"""The training routes as a Serve app ("art-train" at /_art): one replica owns a RayBackend, so a client
without Ray trains over HTTP what a driver script trains through RayBackend, on the same cluster and
behind the same proxy as the OpenAI endpoint."""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.background import BackgroundTask

from art_ray.access import AccessTable, KeyGrant
from art_ray.backend import BackendError, RayBackend
from art_ray.deployment import DEPLOYMENT_HEADER, MISDIRECTED_STATUS, deployment_identity, misdirected_message
from art_ray.errors import ArtRayError, QuotaExceededError
from art_ray.remote.openapi import training_openapi
from art_ray.remote.protocol import (
    DEFAULT_ROUTE_PREFIX,
    DeleteCheckpointsRequest,
    DeleteCheckpointsResponse,
    DeleteRunRequest,
    DeleteRunResponse,
    ErrorBody,
    LogRequest,
    LogResponse,
    MaturedTrafficRequest,
    ModelRef,
    ModelSpec,
    RegisterResponse,
    ReleaseRequest,
    StepResponse,
    TrainRequest,
    TrainSFTRequest,
    TrainStreamLine,
)
from art_ray.serving.replica_grpc import bind_replica_grpc_to_node_address
from art_ray.tinker.config import TinkerConfig
from art_ray.tinker.service import RayTinkerService
from art_ray.tinker.types import TINKER_VERBS, TinkerUserError
from art_ray.train_result import TrainEvent, TrainResult

if TYPE_CHECKING:
    from art_ray.model import TrainableModel

APP_NAME = "art-train"
Body = TypeVar("Body", bound=pydantic.BaseModel)


class TrainingServerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    storage: str = "./art_ray_runs"
    api_key: str | None = None
    tracking_uri: str | None = None
    # the inference app the registered models are served by (started on the first register)
    inference_app_name: str = "art"
    inference_route_prefix: str = "/"
    # the Tinker API in front of this server's backend (art_ray/tinker/); None: not served
    tinker: TinkerConfig | None = None


class AuthRequiredError(ArtRayError, ValueError):
    """A training server reachable from other hosts must have an API key."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.body = ErrorBody(message=message, type=error_type, code=status)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse({"error": error.body.model_dump()}, status_code=error.body.code)


# Defined before the deployment class: Serve serializes the class with the module globals defined by then.
async def _access() -> AccessTable:
    """The cluster's run keys and owners; none before an inference app made the registry."""
    from art_ray.adapters.registry import get_registry

    try:
        registry = get_registry()
    except ValueError:
        return AccessTable()
    return await registry.access.remote()


def _refuse_browser_requests(request: Request) -> None:
    """A web page can make a browser send a request to a server on the user's own machine; without a key
    nothing else would stop it from starting training. Pages send an Origin header, and without a CORS
    preflight (which nothing here answers) only form or text bodies: refuse both."""
    origin = request.headers.get("origin")
    if origin is not None:
        raise ApiError(
            403,
            f"cross-origin request refused (Origin: {origin}): the training routes take calls from "
            "programs, not web pages",
            "permission_error",
        )
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(
            415, "send the body as JSON, with 'Content-Type: application/json'", "invalid_request_error"
        )


# its document is art_ray/remote/openapi.py's, behind the key (GET /openapi.json below)
app = FastAPI(title="art-ray training", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class TrainingServer:
    """One replica: it owns the trainer groups (actors) of the models registered through it."""

    def __init__(self, config: dict, deployment: str | None = None) -> None:
        bind_replica_grpc_to_node_address()
        self.config = TrainingServerConfig.model_validate(config)
        # this app's identity (art_ray/deployment.py): on every response; a request for another: 421
        self.deployment = deployment
        self.backend = RayBackend(
            storage=self.config.storage,
            api_key=self.config.api_key,
            app_name=self.config.inference_app_name,
            route_prefix=self.config.inference_route_prefix,
            tracking_uri=self.config.tracking_uri,
        )
        self.models: dict[str, TrainableModel] = {}
        self.train_locks: dict[str, asyncio.Lock] = {}
        self.register_lock = asyncio.Lock()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.document = training_openapi()
        tinker = self.config.tinker
        self.tinker = (
            RayTinkerService(self.backend, tinker.base_models, tinker.run_config)
            if tinker is not None
            else None
        )

    async def _call(
        self,
        request: Request,
        body_type: type[Body],
        handler: Callable[[Body, KeyGrant | None], Awaitable[Response]],
    ) -> Response:
        """Checks, then `handler(body, grant)` (grant: the caller's run key, None for the admin key). A run
        key's requests count against its `max_concurrent_requests` until their response is sent."""
        grant: KeyGrant | None = None
        counted = False
        try:
            self._check_deployment(request)
            _refuse_browser_requests(request)
            grant = await self._authorize(request)
            limit = grant.max_concurrent_requests if grant else None
            if grant is not None and limit is not None:
                if self.in_flight[grant.name] >= limit:
                    message = f"too many requests in flight for the key {grant.name!r}: at most {limit}"
                    raise ApiError(429, message, "rate_limit_error")
                self.in_flight[grant.name] += 1
                counted = True
            try:
                body = body_type.model_validate_json(await request.body())
            except pydantic.ValidationError as invalid:
                details = "; ".join(
                    f"{'.'.join(str(part) for part in e['loc']) or 'body'}: {e['msg']}"
                    for e in invalid.errors(include_url=False)[:5]
                )
                raise ApiError(
                    400, f"invalid {body_type.__name__}: {details}", "invalid_request_error"
                ) from None
            response = await handler(body, grant)
        except ApiError as error:
            response = error_response(error)
        except QuotaExceededError as error:
            response = error_response(ApiError(413, str(error), "request_too_large"))
        except (BackendError, ArtRayError, ValueError) as error:
            response = error_response(ApiError(400, str(error), "invalid_request_error"))
        except BaseException:
            if counted:
                self.in_flight[grant.name] -= 1  # type: ignore[union-attr]
            raise
        self._stamp(response)
        if counted:
            assert grant is not None
            name = grant.name

            def release() -> None:
                self.in_flight[name] -= 1

            # a stream is still being sent: the request ends when its last line is
            if response.background is None:
                response.background = BackgroundTask(release)
            else:
                release()
        return response

    def _check_deployment(self, request: Request) -> None:
        wanted = request.headers.get(DEPLOYMENT_HEADER)
        if self.deployment is not None and wanted is not None and wanted != self.deployment:
            message = misdirected_message(wanted, self.deployment)
            raise ApiError(MISDIRECTED_STATUS, message, "misdirected_request")

    def _stamp(self, response: Response) -> None:
        if self.deployment is not None:
            response.headers[DEPLOYMENT_HEADER] = self.deployment

    async def _authorize(self, request: Request) -> KeyGrant | None:
        """The caller's run key, or None for the admin key (anyone, on a server without a key)."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key if scheme.lower() == "bearer" else ""
        grant = (await _access()).grant_for(key)
        if grant is not None:
            return grant
        if self.config.api_key is None or hmac.compare_digest(key.encode(), self.config.api_key.encode()):
            return None
        raise ApiError(
            401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error"
        )

    def _model(self, name: str, grant: KeyGrant | None) -> TrainableModel:
        if name in self.models and not self.backend.is_registered(name):  # expired (idle_ttl_s)
            del self.models[name]
        model = self.models.get(name)
        if model is None or (grant is not None and model.config.owner != grant.name):
            raise ApiError(
                404, f"model {name!r} is not registered on this server: register it first", "not_found_error"
            )
        return model

    @app.post("/register")
    async def register(self, request: Request) -> Response:
        async def handle(spec: ModelSpec, grant: KeyGrant | None) -> Response:
            if grant is not None:  # a run key's runs are its own
                if spec.config.owner not in (None, grant.name):
                    message = "a run key registers runs it owns: leave ModelConfig.owner unset"
                    raise ApiError(403, message, "permission_error")
                owned = spec.config.model_copy(update={"owner": grant.name})
                spec = spec.model_copy(update={"config": owned})
            async with self.register_lock:
                model = self.models.get(spec.name)
                if model is not None and grant is not None and model.config.owner != grant.name:
                    message = f"the model name {spec.name!r} is not available: choose another"
                    raise ApiError(409, message, "conflict_error")
                if model is not None and ModelSpec.of(model) != spec:
                    raise ApiError(
                        409,
                        f"model {spec.name!r} is registered with another base model or config",
                        "conflict_error",
                    )
                if model is None:
                    model = spec.trainable_model()
                    try:
                        await model.register(self.backend)
                    except BackendError as error:
                        raise ApiError(409, str(error), "conflict_error") from None
                    self.models[spec.name] = model
                    self.train_locks[spec.name] = asyncio.Lock()
            response = RegisterResponse(
                step=await model.get_step(),
                inference_path=self.config.inference_route_prefix.rstrip("/") + "/v1",
                inference_deployment=self.backend.deployment,
                model_dir=self.backend.model_dir(model),
                tracking_uri=self.backend.tracker(model).tracking_uri,
            )
            return JSONResponse(response.model_dump())

        return await self._call(request, ModelSpec, handle)

    @app.post("/train")
    async def train(self, request: Request) -> Response:
        async def handle(body: TrainRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            for group in body.groups:  # a 400 now rather than an error line after the stream started
                for trajectory in group.trajectories:
                    trajectory.check_trainable()
            events = self.backend.train(model, body.groups, body.config)
            return StreamingResponse(self._train_lines(model, events), media_type="application/x-ndjson")

        return await self._call(request, TrainRequest, handle)

    @app.post("/train_sft")
    async def train_sft(self, request: Request) -> Response:
        async def handle(body: TrainSFTRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            for trajectory in body.trajectories:
                trajectory.check_trainable()
            body.config.steps(len(body.trajectories))  # a learning-rate list that does not fit: a 400
            events = self.backend.train_sft(model, body.trajectories, body.config)
            return StreamingResponse(self._train_lines(model, events), media_type="application/x-ndjson")

        return await self._call(request, TrainSFTRequest, handle)

    async def _train_lines(
        self, model: TrainableModel, events: AsyncIterator[TrainEvent]
    ) -> AsyncIterator[str]:
        async with self.train_locks[model.name]:  # one step at a time per model, in arrival order
            try:
                async for event in events:
                    line = (
                        TrainStreamLine(result=event)
                        if isinstance(event, TrainResult)
                        else TrainStreamLine(gradient_step=event)
                    )
                    yield line.model_dump_json(exclude_none=True) + "\n"
            except QuotaExceededError as error:  # found as the batch was packed: nothing trained
                body_error = ErrorBody(message=str(error), type="request_too_large", code=413)
                yield TrainStreamLine(error=body_error).model_dump_json(exclude_none=True) + "\n"
            except Exception as error:  # headers are sent: the error travels as the stream's last line
                body_error = ErrorBody(
                    message=f"{type(error).__name__}: {error}", type="training_error", code=500
                )
                yield TrainStreamLine(error=body_error).model_dump_json(exclude_none=True) + "\n"

    @app.post("/log")
    async def log(self, request: Request) -> Response:
        async def handle(body: LogRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            metrics = await self.backend.log(model, body.groups, body.split, body.metrics)
            return JSONResponse(LogResponse(metrics=metrics).model_dump(mode="json"))

        return await self._call(request, LogRequest, handle)

    @app.post("/step")
    async def step(self, request: Request) -> Response:
        async def handle(body: ModelRef, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            return JSONResponse(StepResponse(step=await self.backend.get_step(model)).model_dump())

        return await self._call(request, ModelRef, handle)

    @app.post("/traffic")
    async def traffic(self, request: Request) -> Response:
        async def handle(body: ModelRef, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            return JSONResponse((await self.backend.traffic(model)).model_dump(mode="json"))

        return await self._call(request, ModelRef, handle)

    @app.post("/release")
    async def release(self, request: Request) -> Response:
        async def handle(body: ReleaseRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            state = await self.backend.release(model, body.action)
            return JSONResponse(state.model_dump(mode="json"))

        return await self._call(request, ReleaseRequest, handle)

    @app.post("/matured_traffic")
    async def matured_traffic(self, request: Request) -> Response:
        async def handle(body: MaturedTrafficRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            matured = await self.backend.matured_traffic(model, body.after, body.limit)
            return JSONResponse(matured.model_dump(mode="json"))

        return await self._call(request, MaturedTrafficRequest, handle)

    @app.post("/delete_checkpoints")
    async def delete_checkpoints(self, request: Request) -> Response:
        async def handle(body: DeleteCheckpointsRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            async with self.train_locks[model.name]:
                deleted = await self.backend.delete_checkpoints(
                    model, body.best_checkpoint_metric, body.steps_to_keep
                )
            return JSONResponse(DeleteCheckpointsResponse(deleted=deleted).model_dump())

        return await self._call(request, DeleteCheckpointsRequest, handle)

    @app.post("/delete_run")
    async def delete_run(self, request: Request) -> Response:
        async def handle(body: DeleteRunRequest, grant: KeyGrant | None) -> Response:
            model = self._model(body.model, grant)
            async with self.train_locks[model.name]:  # after the train call in flight, if one is
                if self.models.get(model.name) is model:
                    await self.backend.delete_run(model, body.purge_checkpoints)
                    del self.models[model.name]
            return JSONResponse(DeleteRunResponse(model=model.name).model_dump())

        return await self._call(request, DeleteRunRequest, handle)

    async def tinker_call(self, verb: str, *args: Any) -> Any:
        """A TinkerService verb on this replica's backend, for the Tinker front (art_ray/tinker/server.py),
        so Tinker runs share the trainers and engines of the runs registered here."""
        if self.tinker is None or verb not in TINKER_VERBS:
            raise TinkerUserError(
                "this training server does not serve the Tinker API: start it with --tinker"
            )
        return await getattr(self.tinker, verb)(*args)

    @app.get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        try:
            self._check_deployment(request)
            if request.headers.get("origin") is not None:
                raise ApiError(403, "cross-origin request refused", "permission_error")
            await self._authorize(request)
            response: Response = JSONResponse(self.document)
        except ApiError as error:
            response = error_response(error)
        self._stamp(response)
        return response

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        try:
            self._check_deployment(request)
            response: Response = JSONResponse({"models": sorted(self.models)})
        except ApiError as error:
            response = error_response(error)
        self._stamp(response)
        return response

    def __del__(self) -> None:
        # the trainers' placement groups would outlive this replica; the inference app stays up (deleting
        # an app from inside another app's shutdown can wait on the controller that is deleting us)
        self.backend.stop_trainers()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_auth_off_localhost(host: str, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        raise AuthRequiredError(
            f"Serve listens on {host}, reachable from other hosts: give the training server an api_key"
        )


def start_training_server(
    config: TrainingServerConfig,
    host: str = "127.0.0.1",
    port: int | None = None,
    route_prefix: str = DEFAULT_ROUTE_PREFIX,
    app_name: str = APP_NAME,
    how_to_choose: str = "start_training_server(port=...)",
) -> str:
    """Deploy the training routes on the connected cluster's Serve and return the server's base URL (what
    `HTTPBackend(base_url)` takes). Refuses to run without an API key where other hosts can reach it.
    When this starts Serve: `port` None takes 8000 if free, else a free port; a `port` another process
    listens on raises PortInUseError, `how_to_choose` saying how to pick another (art_ray/serve_port.py)."""
    from art_ray.serve_deploy import proxy_url, run_app, start_serve

    require_auth_off_localhost(host, config.api_key)  # before Serve listens anywhere
    listening = start_serve(host, port, how_to_choose)  # a running Serve keeps the options it started with
    require_auth_off_localhost(listening[0], config.api_key)
    server = TrainingServer.bind(config.model_dump(), deployment_identity(app_name))
    run_app(server, name=app_name, route_prefix=route_prefix)
    if config.tinker is not None:
        from art_ray.tinker.server import TinkerFront

        front = TinkerFront.bind(config.tinker.model_dump(), app_name, config.api_key)
        run_app(front, name=config.tinker.app_name, route_prefix=config.tinker.route_prefix)
    return proxy_url(*listening)
