"""The Serve deployment: one vLLM engine per replica, vLLM's OpenAI app as its HTTP ingress."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from functools import cache
from pathlib import Path

import ray
from ray import serve
from starlette.middleware import Middleware

from art_ray import storage
from art_ray.access import AccessTable
from art_ray.adapters.lora_files import PackedAdapter
from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, AdapterVersion, ensure_registry, get_registry
from art_ray.adapters.spec import validate_model_name
from art_ray.capture.store import ensure_capture_store, get_capture_store
from art_ray.colocation import EngineHandover
from art_ray.deployment import deployment_identity
from art_ray.serving.adapter_store import AdapterStore
from art_ray.serving.capture import CaptureMiddleware
from art_ray.serving.config import ServedCheckpoint, ServingConfig
from art_ray.serving.disconnect import DisconnectOnCancel
from art_ray.serving.endpoint_guard import MESSAGES_PATH, RESPONSES_PATH, EndpointGuard
from art_ray.serving.engine_exit import EngineExit
from art_ray.serving.feedback_route import FeedbackMiddleware
from art_ray.serving.feedback_token import FeedbackSigner
from art_ray.serving.messages_bridge import MessagesBridge
from art_ray.serving.middleware import ModelRoutingMiddleware
from art_ray.serving.openapi import endpoint_openapi
from art_ray.serving.protocol_bridge import ProtocolBridge
from art_ray.serving.replica_grpc import bind_replica_grpc_to_node_address
from art_ray.serving.response_store import ClusterResponseHistory
from art_ray.serving.responses_bridge import ResponsesBridge
from art_ray.serving.traffic_logs import TrafficLogs
from art_ray.serving.vllm_app import build_engine_and_app
from art_ray.unused_imports import skip_unused_imports

logger = logging.getLogger(__name__)


@serve.ingress()
class InferenceReplica:
    async def __init__(self, config: ServingConfig, deployment: str | None = None) -> None:
        skip_unused_imports()  # before vLLM imports transformers
        bind_replica_grpc_to_node_address()
        self._config = config
        self._access = AccessTable()  # the registry's, taken below and kept current by its pushes
        self._engine, self._app = await build_engine_and_app(config)
        self._app.state.server = EngineExit()  # vLLM's handler of a dead engine stops "the server" there
        self._handover = EngineHandover(self._engine, config.engine.device)
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        root = Path(config.adapter_dir or tempfile.gettempdir()) / "art_ray_adapters"
        self._registry = get_registry()
        self._adapters = AdapterStore(
            self._app.state.openai_serving_models,
            self._engine,
            root / f"{config.app_name}-{replica_id}-{os.getpid()}",
            config.keep_versions,
            config.engine.model,
            self._registry.get.remote,
            pinned=self._release_arms,
        )
        # Outermost: a cancelled request tells vLLM its client left, then the gate (routes, key), feedback,
        # the Responses and Messages protocols as chat completions, capture sessions and stored traffic;
        # innermost, after vLLM's own middleware: model names and per-request limits.
        signer = FeedbackSigner(config.api_key or deployment or config.app_name)
        traffic_logs = TrafficLogs()
        self._app.user_middleware[:0] = [
            Middleware(DisconnectOnCancel),
            Middleware(
                EndpointGuard, api_key=config.api_key, access=self.current_access, deployment=deployment
            ),
            Middleware(FeedbackMiddleware, signer=signer, traffic_logs=traffic_logs),
            Middleware(
                ProtocolBridge,
                bridges={
                    RESPONSES_PATH: ResponsesBridge(ClusterResponseHistory(config.response_store_max_bytes)),
                    MESSAGES_PATH: MessagesBridge(self._app.state.anthropic_serving_messages),
                },
            ),
            Middleware(CaptureMiddleware, store=get_capture_store, traffic_logs=traffic_logs, signer=signer),
        ]
        self._app.user_middleware.append(
            Middleware(
                ModelRoutingMiddleware,
                versions=self._adapters,
                max_n=config.max_n,
                default_max_tokens=config.default_max_tokens,
            )
        )
        self._app.middleware_stack = None  # vLLM's setup already built the stack; rebuild it with ours
        # FastAPI's /openapi.json route calls app.openapi(); vLLM's document takes ~1.7 CPU seconds to build,
        # so it is built at the first request for it, not at every replica's start
        vllm_openapi = self._app.openapi
        self._app.openapi = cache(lambda: endpoint_openapi(vllm_openapi()))
        await self._registry.subscribe.remote(context.app_name, context.deployment)
        await self.update_access(await self._registry.access.remote())
        # Before taking traffic: serve the configured checkpoints and the versions the registry keeps.
        for checkpoint in config.checkpoints:
            await self._load_checkpoint(checkpoint, root / "checkpoints" / f"{replica_id}-{os.getpid()}")
        for version in await self._registry.kept_versions.remote():
            if not self._adapters.serves_base(version):
                continue
            try:
                await self._adapters.load(version)
            except ray.exceptions.RayError as error:  # e.g. its node died: the newer versions still load
                logger.warning("not serving %s@%d: %s", version.model, version.step, error)

    def __serve_build_asgi_app__(self):  # type: ignore[no-untyped-def]
        return self._app

    async def load_adapter(self, version: AdapterVersion) -> dict[str, list[int]] | None:
        """Called on every replica by the registry's broadcast; returns what this replica serves, or None
        when it serves another base model."""
        if not self._adapters.serves_base(version):
            return None
        await self._adapters.load(version)
        return self._adapters.served_models()

    async def unload_model(self, model: str) -> bool:
        """Called on every replica by the registry when a run is deleted: its versions stop being served."""
        return await self._adapters.unload_model(model)

    def _release_arms(self, model: str) -> set[int]:
        release = self._access.releases.get(model)
        return set(release.arms().values()) if release is not None else set()

    def current_access(self) -> AccessTable:
        return self._access

    async def update_access(self, table: AccessTable) -> None:
        """The registry's push of its run keys and owners (art_ray/access.py); an older one is ignored."""
        if table.version >= self._access.version:
            self._access = table

    async def access_table(self) -> AccessTable:
        """What this replica knows of keys and owners: a restarted registry takes it back."""
        return self._access

    async def held_adapters(self) -> list[tuple[AdapterVersion, PackedAdapter]]:
        """The registry's versions this replica serves, tensors included: a restarted registry takes them
        back from its replicas (it owned the originals, which died with it)."""
        return await self._adapters.held_versions()

    async def handover(self, base_model: str, action: str) -> bool:
        """Colocated layout: give the devices to the trainer of `base_model` or take them back."""
        if base_model != self._config.engine.model:
            return False
        if action == "release":
            await self._handover.release()
        elif action == "reclaim":
            await self._handover.reclaim()
        else:
            raise ValueError(f"unknown hand-over action {action!r}")
        return True

    async def load_adapter_folder(self, model: str, step: int, folder: str) -> dict[str, list[int]]:
        """Serve a PEFT adapter folder on this node's disk (e.g. a checkpoint) as `model@step`."""
        await self._adapters.load_folder(validate_model_name(model), step, Path(folder))
        return self._adapters.served_models()

    async def _load_checkpoint(self, checkpoint: ServedCheckpoint, scratch: Path) -> None:
        folder = Path(checkpoint.path)
        if not folder.is_dir():  # a remote URI: copy it to this node first
            local = scratch / checkpoint.model / f"{checkpoint.step:06d}"
            folder = await asyncio.to_thread(storage.download_dir, checkpoint.path, local)
        await self._adapters.load_folder(validate_model_name(checkpoint.model), checkpoint.step, folder)

    async def served_models(self) -> dict[str, list[int]]:
        return self._adapters.served_models()

    async def unfinished_requests(self) -> int:
        """Requests the engine is generating or has queued (0 once abandoned requests were aborted)."""
        return self._engine.get_num_unfinished_requests()

    async def check_health(self) -> None:
        await self._engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def replica_actor_options(config: ServingConfig) -> dict:
    # The engine's environment (threads, KV cache size) is applied in the replica, before it spawns the
    # engine process: "all cores" is only known on the node that runs it.
    options: dict = {"num_cpus": config.replica_cpus}
    if config.replica_gpus:
        options["num_gpus"] = config.replica_gpus
    if config.replica_resources:
        options["resources"] = dict(config.replica_resources)
    return options


def build_inference_app(config: ServingConfig, deployment: str | None = None) -> serve.Application:
    """A Serve application (`serve.run(app)`) serving the OpenAI API for the configured base model; the
    LoRA registry its replicas subscribe to is created here if the cluster has none. `deployment`: the
    identity every response carries and a client may ask for (art_ray/deployment.py); by default the app's
    name on this cluster."""
    ensure_registry()
    ensure_capture_store(config.capture_max_bytes, config.capture_ttl_s)
    scaling = (
        {"autoscaling_config": config.autoscaling.model_dump()}
        if config.autoscaling
        else {"num_replicas": config.num_replicas}
    )
    replicas = serve.deployment(
        InferenceReplica,
        name=INFERENCE_DEPLOYMENT,
        **scaling,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options=replica_actor_options(config),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=config.drain_timeout_s,
    )
    return replicas.bind(config, deployment or deployment_identity(config.app_name))


__all__ = ["InferenceReplica", "build_inference_app", "ray"]
