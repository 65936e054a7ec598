"""ServingConfig: everything that decides how the inference app runs; it crosses process boundaries."""

from __future__ import annotations

import pydantic

from art_ray.model_config import ReplicaAutoscaling, ToolStrictLevel
from art_ray.placement import NodeShape, resolve_device, role_nodes
from art_ray.serving.engine_config import EngineConfig


class ServedCheckpoint(pydantic.BaseModel):
    """A trained adapter a replica loads at start, served as `model@step` and as `model` (the latest)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    model: str
    step: int = pydantic.Field(ge=0)
    # a checkpoint's PEFT adapter folder: a local path or any pyarrow.fs URI (s3://, gs://, ...), e.g.
    # <storage>/<project>/models/<model>/checkpoints/0008/adapter
    path: str


class ServingConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    engine: EngineConfig
    app_name: str = "art"
    route_prefix: str = "/"
    num_replicas: int = pydantic.Field(default=1, ge=1)
    # Serve's autoscaling between min and max replicas instead of num_replicas (ModelConfig.autoscaling)
    autoscaling: ReplicaAutoscaling | None = None
    # How long a replica Serve stops (scale-down, redeploy) keeps answering the requests it has
    drain_timeout_s: float = pydantic.Field(default=60.0, ge=0)
    # Serve's default of 5 collapsed concurrent throughput 5x: the engine batches, let it.
    max_ongoing_requests: int = pydantic.Field(default=256, ge=1)
    # CPUs Ray reserves per replica; on a 2-core box the engine gets one and the trainer the other.
    replica_cpus: float = pydantic.Field(default=1.0, ge=0)
    # None: one GPU per tensor-parallel rank on GPU nodes, 0 on CPU
    replica_gpus: float | None = pydantic.Field(default=None, ge=0)
    # Custom Ray resources per replica: pins replicas to node types (e.g. {"inference_node": 1}).
    replica_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    # Bearer key every route requires when set (art_ray/serving/endpoint_guard.py).
    api_key: str | None = None
    # The most choices one request may ask for (`n`); OpenAI's own cap is 128.
    max_n: int = pydantic.Field(default=128, ge=1)
    # Tokens a request that names no `max_tokens` may generate (vLLM's default is the whole context: one
    # request with a large `n` held a CPU engine for minutes). Only a default: vLLM's generation-config
    # `max_new_tokens` would cap every request, so the endpoint fills the field in instead.
    default_max_tokens: int = pydantic.Field(default=1024, ge=1)
    # Capture sessions (art_ray/serving/capture.py): the bytes of recorded turns the cluster's store holds
    # before it refuses new ones (429), and how long an unused session lives. The first app's values win.
    capture_max_bytes: int = pydantic.Field(default=256 * 2**20, ge=1)
    capture_ttl_s: float = pydantic.Field(default=3600.0, gt=0)
    # Responses API (`previous_response_id`): the bytes of stored responses' items the cluster keeps; the
    # least recently used beyond are forgotten (a chain through one is then a 404). The first app's wins.
    response_store_max_bytes: int = pydantic.Field(default=64 * 2**20, ge=1)
    # Tool calling: vLLM's parser for the model's tool-call format (e.g. "hermes"), and a chat template
    # (a path or the template text) when the model's own does not render `tools`.
    tool_call_parser: str | None = None
    chat_template: str | None = None
    # What a tool call's grammar pins (ModelConfig.tool_strict_level): "parameter", the arguments too.
    tool_strict_level: ToolStrictLevel = "parameter"
    # The longest run of whitespace between a tool call's JSON tokens (ModelConfig.tool_call_max_whitespace)
    tool_call_max_whitespace: int | None = pydantic.Field(default=4, ge=1)
    # LoRA versions of each model kept loaded per replica; older versions are evicted.
    keep_versions: int = pydantic.Field(default=3, ge=1)
    # Node-local folder where replicas write adapter files for vLLM (no shared filesystem needed).
    adapter_dir: str | None = None
    # Trained adapters to serve from checkpoints (a production endpoint without a trainer).
    checkpoints: list[ServedCheckpoint] = pydantic.Field(default_factory=list)

    def placed(self, shapes: list[NodeShape]) -> ServingConfig:
        """This config with the device and GPUs that were left to the cluster decided from its nodes
        (those that carry `replica_resources`), for a Serve config file or a fixture."""
        nodes = role_nodes(shapes, self.replica_resources, "replica_resources")
        device = resolve_device(self.engine.device, nodes)
        gpus = self.replica_gpus
        if gpus is None:
            gpus = float(self.engine.tensor_parallel_size) if device == "gpu" else 0.0
        engine = self.engine.model_copy(update={"device": device})
        return self.model_copy(update={"engine": engine, "replica_gpus": gpus})

    @pydantic.model_validator(mode="after")
    def _check_lora_slots(self) -> ServingConfig:
        if self.keep_versions > self.engine.max_loras:
            raise ValueError(
                f"keep_versions={self.keep_versions} exceeds engine.max_loras={self.engine.max_loras}: "
                "requests for versions that cannot be batched together would thrash the engine"
            )
        return self
