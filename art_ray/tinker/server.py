"""The Tinker API as a Serve app ("art-tinker" at /api/v1, beside the training server): the front
(art_ray/tinker/api.py) in one replica, its work done by the training server's replica, which owns the
backend, so Tinker runs share the trainers and engines of the runs registered there.

`art-ray serve-training --tinker` deploys it (art_ray/remote/server.py's `start_training_server`)."""

from __future__ import annotations

import hmac
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve

from art_ray import keys
from art_ray.serving.replica_grpc import bind_replica_grpc_to_node_address
from art_ray.tinker.api import tinker_app
from art_ray.tinker.config import TINKER_DEPLOYMENT, TinkerConfig
from art_ray.tinker.principal import Principal, UnknownKeyError
from art_ray.tinker.types import (
    AdamStep,
    ForwardBackwardCall,
    ForwardBackwardResult,
    SampleCall,
    SampleResult,
    SamplerWeights,
    SavedState,
    TinkerModelInfo,
    TinkerModelSpec,
    TinkerRunStatus,
    TinkerUserError,
)

TRAINING_DEPLOYMENT = "TrainingServer"


class TrainingServerWork:
    """TinkerService by calls to the training server's replica (`TrainingServer.tinker_call`)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def _call(self, verb: str, *args: Any) -> Any:
        try:
            return await self._handle.tinker_call.remote(verb, *args)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, TinkerUserError):  # the client's to fix: a failed future, not a 5xx
                raise TinkerUserError(str(error.cause)) from None
            raise

    async def create_model(self, spec: TinkerModelSpec) -> TinkerModelInfo:
        return await self._call("create_model", spec)

    async def forward_backward(self, run: str, call: ForwardBackwardCall) -> ForwardBackwardResult:
        return await self._call("forward_backward", run, call)

    async def optim_step(self, run: str, step: AdamStep) -> dict[str, float]:
        return await self._call("optim_step", run, step)

    async def save_for_sampler(self, run: str) -> SamplerWeights:
        return await self._call("save_for_sampler", run)

    async def save_state(self, run: str, name: str) -> SavedState:
        return await self._call("save_state", run, name)

    async def saved_state(self, run: str, name: str) -> SavedState | None:
        return await self._call("saved_state", run, name)

    async def load_state(self, run: str, state: SavedState, optimizer: bool) -> int:
        return await self._call("load_state", run, state, optimizer)

    async def sample(self, call: SampleCall) -> SampleResult:
        return await self._call("sample", call)

    async def unload(self, run: str) -> None:
        await self._call("unload", run)


@serve.deployment(
    name=TINKER_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0}
)
@serve.ingress()
class TinkerFront:
    """One replica: sessions, futures and the order of each model's calls live in it."""

    def __init__(self, config: dict, training_app: str, api_key: str | None) -> None:
        bind_replica_grpc_to_node_address()
        self.config = TinkerConfig.model_validate(config)
        self.api_key = api_key
        handle = serve.get_deployment_handle(TRAINING_DEPLOYMENT, app_name=training_app)
        self.work = TrainingServerWork(handle)

    async def authorize(self, key: str | None) -> Principal:
        """The admin key (anyone, on a server without one) or a run key of the cluster's table."""
        grant = (await keys.access_table()).grant_for(key)
        if grant is not None:
            return Principal(name=grant.name, max_concurrent_requests=grant.max_concurrent_requests)
        if self.api_key is None or (
            key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())
        ):
            return Principal()
        raise UnknownKeyError(
            "missing or unknown API key: send a run key made with --prefix tml- as X-API-Key"
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        self.asgi_app = tinker_app(
            self.work, self.authorize, self.config.base_models, session_ttl_s=self.config.session_ttl_s
        )
        return self.asgi_app

    def run_statuses(self) -> list[TinkerRunStatus]:
        """The live training clients' runs (`art-ray status`)."""
        return self.asgi_app.state.front.run_statuses()
