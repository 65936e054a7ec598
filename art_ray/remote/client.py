"""HTTPBackend: a backend for drivers that don't run Ray. It calls a training server's routes
(`art-ray serve-training`, art_ray.remote.server) with RayBackend's verbs, so the same driver script
trains on a remote cluster by swapping the backend; rollouts call the server's OpenAI endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pydantic

from art_ray.deployment import DEPLOYMENT_HEADER, deployment_headers
from art_ray.errors import ArtRayError, BackendError
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
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import TrainEvent
from art_ray.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_ray.model import TrainableModel
    from art_ray.releases import ReleaseAction, ReleaseState
    from art_ray.tracking import Tracker
    from art_ray.traffic.records import MaturedTraffic, TrafficCursor, TrafficSnapshot

Reply = TypeVar("Reply", bound=pydantic.BaseModel)


class RemoteTrainingError(ArtRayError, RuntimeError):
    """The training server refused a request or failed it; `status` and `type` come from its error JSON."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.type = error_type


def _error(response_status: int, text: str) -> RemoteTrainingError:
    try:
        body = ErrorBody.model_validate(pydantic.TypeAdapter(dict[str, Any]).validate_json(text)["error"])
        return RemoteTrainingError(body.code, body.type, body.message)
    except (pydantic.ValidationError, KeyError, TypeError):
        return RemoteTrainingError(response_status, "http_error", text[:500])


class HTTPBackend:
    """Serves and trains TrainableModels through a training server at `base_url` (e.g.
    "http://head-node:8000"), authenticating with `api_key` (also the OpenAI endpoint's key). Metrics,
    trajectories and checkpoints stay on the server's storage."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        route_prefix: str = DEFAULT_ROUTE_PREFIX,
        timeout: float = 3600.0,
    ) -> None:
        self.server_url = base_url.rstrip("/")
        self.api_key = api_key
        self.routes_url = self.server_url + "/" + route_prefix.strip("/")
        self.timeout = timeout
        self.base_url: str | None = None  # the OpenAI endpoint, known once a model is registered
        self.deployment: str | None = None  # its identity (art_ray/deployment.py), known then too
        # the training server's identity, from its first answer: every later request asks for it, so
        # another deployment that shares its port refuses them (421) instead of training
        self.server_deployment: str | None = None
        self.tracking_uri: str | None = None
        self._model_dirs: dict[str, str] = {}

    def _client(self) -> httpx.AsyncClient:
        # one per call: calls are few and long, and a client is bound to the event loop that first used it
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers.update(deployment_headers(self.server_deployment))
        return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout, connect=30.0))

    def _learn_server(self, response: httpx.Response) -> None:
        if self.server_deployment is None and response.status_code == 200:
            self.server_deployment = response.headers.get(DEPLOYMENT_HEADER)

    async def _post(self, route: str, body: pydantic.BaseModel, reply_type: type[Reply]) -> Reply:
        async with self._client() as client:
            response = await client.post(
                f"{self.routes_url}/{route}",
                content=body.model_dump_json(),
                headers={"Content-Type": "application/json"},
            )
        if response.status_code != 200:
            raise _error(response.status_code, response.text)
        self._learn_server(response)
        return reply_type.model_validate_json(response.content)

    async def register(self, model: TrainableModel) -> None:
        """Have the server serve and train the model (resuming from its latest checkpoint)."""
        reply = await self._post("register", ModelSpec.of(model), RegisterResponse)
        self.base_url = self.server_url + reply.inference_path
        self.deployment = reply.inference_deployment
        self.tracking_uri = reply.tracking_uri
        self._model_dirs[model.name] = reply.model_dir

    async def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> AsyncIterator[TrainEvent]:
        """Yield each gradient step as the server streams it, then the TrainResult."""
        async for event in self._stream(
            "train", TrainRequest(model=model.name, groups=groups, config=config)
        ):
            yield event

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[TrainEvent]:
        body = TrainSFTRequest(model=model.name, trajectories=trajectories, config=config)
        async for event in self._stream("train_sft", body):
            yield event

    async def _stream(self, route: str, body: pydantic.BaseModel) -> AsyncIterator[TrainEvent]:
        async with (
            self._client() as client,
            client.stream(
                "POST",
                f"{self.routes_url}/{route}",
                content=body.model_dump_json(),
                headers={"Content-Type": "application/json"},
            ) as response,
        ):
            if response.status_code != 200:
                raise _error(response.status_code, (await response.aread()).decode(errors="replace"))
            self._learn_server(response)
            finished = False
            async for text in response.aiter_lines():
                if not text.strip():
                    continue
                line = TrainStreamLine.model_validate_json(text)
                if line.error is not None:
                    raise RemoteTrainingError(line.error.code, line.error.type, line.error.message)
                if line.gradient_step is not None:
                    yield line.gradient_step
                if line.result is not None:
                    finished = True
                    yield line.result
        if not finished:
            raise RemoteTrainingError(502, "stream_error", "the train stream ended before the step finished")

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]:
        body = LogRequest(model=model.name, groups=groups, split=split, metrics=metrics or {})
        return (await self._post("log", body, LogResponse)).metrics

    async def get_step(self, model: TrainableModel) -> int:
        return (await self._post("step", ModelRef(model=model.name), StepResponse)).step

    async def traffic(self, model: TrainableModel) -> TrafficSnapshot:
        """The run's stored turns and feedback (ModelConfig.traffic), read by the server."""
        from art_ray.traffic.records import TrafficSnapshot

        return await self._post("traffic", ModelRef(model=model.name), TrafficSnapshot)

    async def release(self, model: TrainableModel, action: ReleaseAction) -> ReleaseState:
        """Read or move the run's release, on the server."""
        from art_ray.releases import ReleaseState

        return await self._post("release", ReleaseRequest(model=model.name, action=action), ReleaseState)

    async def matured_traffic(
        self, model: TrainableModel, after: TrafficCursor | None, limit: int
    ) -> MaturedTraffic:
        """The run's labeled turns past `after`, read by the server."""
        from art_ray.traffic.records import MaturedTraffic

        request = MaturedTrafficRequest(model=model.name, after=after, limit=limit)
        return await self._post("matured_traffic", request, MaturedTraffic)

    async def delete_checkpoints(
        self,
        model: TrainableModel,
        best_checkpoint_metric: str = "val/reward",
        steps_to_keep: list[int] | None = None,
    ) -> list[int]:
        body = DeleteCheckpointsRequest(
            model=model.name, best_checkpoint_metric=best_checkpoint_metric, steps_to_keep=steps_to_keep
        )
        return (await self._post("delete_checkpoints", body, DeleteCheckpointsResponse)).deleted

    async def delete_run(self, model: TrainableModel, purge_checkpoints: bool = False) -> None:
        """RayBackend.delete_run on the server (after a train call of the run in flight finishes)."""
        body = DeleteRunRequest(model=model.name, purge_checkpoints=purge_checkpoints)
        await self._post("delete_run", body, DeleteRunResponse)
        self._model_dirs.pop(model.name, None)

    def model_dir(self, model: TrainableModel) -> str:
        """The model's folder on the server's storage."""
        if model.name not in self._model_dirs:
            raise BackendError(f"model {model.name!r} is not registered: await model.register(backend) first")
        return self._model_dirs[model.name]

    def tracker(self, model: TrainableModel) -> Tracker:
        raise BackendError(
            f"an HTTPBackend's metrics are tracked by the server (MLflow at {self.tracking_uri}); "
            "model.log() and model.train() record them there"
        )

    def shutdown(self) -> None:
        """Nothing runs locally; the server keeps serving and training for other clients."""
