"""ModelConfig: per-model settings of a TrainableModel (adapter shape, trainer and serving sizes)."""

from __future__ import annotations

from typing import Literal

import pydantic

from art_ray.adapters.spec import LoRASpec
from art_ray.feedback import TrafficConfig
from art_ray.releases import ReleasePolicy

# vLLM's ToolStrictLevelName (vllm/tool_parsers/tool_strict_level.py), spelled here so configs import no vLLM
ToolStrictLevel = Literal["auto", "function", "parameter"]


class ReplicaAutoscaling(pydantic.BaseModel):
    """Ray Serve's autoscaling of the inference replicas, with Serve's own field names and defaults: Serve
    adds a replica while the replicas average more than `target_ongoing_requests` requests each (after
    `upscale_delay_s`) and removes one below it (after `downscale_delay_s`). A new replica loads the
    adapter versions the registry keeps before it takes traffic."""

    model_config = pydantic.ConfigDict(extra="forbid")

    min_replicas: int = pydantic.Field(default=1, ge=1)
    max_replicas: int = pydantic.Field(default=1, ge=1)
    target_ongoing_requests: float = pydantic.Field(default=2.0, gt=0)
    upscale_delay_s: float = pydantic.Field(default=30.0, ge=0)
    downscale_delay_s: float = pydantic.Field(default=600.0, ge=0)
    metrics_interval_s: float = pydantic.Field(default=10.0, gt=0)
    look_back_period_s: float = pydantic.Field(default=30.0, gt=0)

    @pydantic.model_validator(mode="after")
    def _check_range(self) -> ReplicaAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}")
        return self


class ModelConfig(pydantic.BaseModel):
    """A TrainableModel's settings for its whole run: the LoRA shape, the layout and sizes of its trainer
    and inference replicas, serving limits, run keys, traffic capture. One config spine: the role configs
    (art_ray/role_configs.py) take their fields from it by name."""

    model_config = pydantic.ConfigDict(extra="forbid")

    lora: LoRASpec = pydantic.Field(default_factory=LoRASpec)
    # Placement (art_ray/placement.py), decided from the cluster's nodes, never the driver's devices.
    # "colocated": engine and trainer share the devices and take turns, each phase on all of them (one CPU
    # box, one GPU); "split": each on devices of its own. "auto": colocated where they would share anyway.
    layout: Literal["auto", "colocated", "split"] = "auto"
    # "auto": GPU when the nodes that can run the role have GPUs
    device: Literal["auto", "cpu", "gpu"] = "auto"
    # How long register() waits for an autoscaler to add nodes before it raises PlacementError.
    placement_timeout_s: float = pydantic.Field(default=600.0, ge=0)
    # trainer
    # at most 4,096 ranks (512 nodes of 8 GPUs): a larger one is a typo, and planning it alone took the
    # training server minutes (bench/fuzz.py sent 117,327,737)
    world_size: int = pydantic.Field(default=1, ge=1, le=4096)
    zero_stage: Literal[0, 1, 2, 3] = 0
    # Packed row length in tokens; a sequence longer than this is an error, never silently cut.
    sequence_length: int = pydantic.Field(default=2048, ge=16)
    # Rows per forward/backward on one rank; gradients accumulate over a rank's rows before the step.
    micro_batch_rows: int = pydantic.Field(default=4, ge=1)
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    adam_epsilon: float = pydantic.Field(default=1e-8, gt=0)
    trainer_cpus_per_rank: float = pydantic.Field(default=1.0, ge=0)
    trainer_gpus_per_rank: float | None = None  # None: 1 on GPU (0.5 colocated), 0 on CPU
    # None: every core of the node when colocated on CPU, else the CPUs the rank reserves
    trainer_threads: int | None = pydantic.Field(default=None, ge=1)
    # Custom Ray resources per trainer rank / inference replica: pin them to node types of the cluster
    # (cluster.yaml gives worker types resources such as {"trainer_node": 1}).
    trainer_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    seed: int = 0
    # Train on the trainer group of a model already registered on the backend when their base model and
    # trainer settings agree (one copy of the base weights; train calls take turns, round-robin across the
    # runs; art_ray/trainer/runs.py says what may differ). CPU trainers at zero_stage 0; others get their own.
    share_trainer: bool = False
    # The name of the run key that owns this run (RayBackend.create_key; art_ray/access.py): that key
    # samples, captures and trains it, other run keys are answered 404 for it. None: the admin key only. A
    # training server sets it to its caller's key name.
    owner: str | None = None
    # A run with no register, train, train_sft, log or get_step call for this long is deleted as by
    # RayBackend.delete_run (its checkpoints stay: registering it again resumes it). None: never.
    idle_ttl_s: float | None = pydantic.Field(default=None, gt=0)
    # serving
    num_replicas: int = pydantic.Field(default=1, ge=1)
    # None: num_replicas, fixed; set: Serve scales the replicas between its min and max (num_replicas unused)
    autoscaling: ReplicaAutoscaling | None = None
    max_model_len: int = pydantic.Field(default=2048, ge=16)
    # The sequences an engine runs at once (vLLM's max_num_seqs); more wait in its queue.
    max_num_seqs: int = pydantic.Field(default=64, ge=1)
    # CPU engines: the KV cache in tokens, allocated whole when the engine starts. None: the run's need,
    # max_num_seqs conversations of sequence_length tokens (no longer one can be trained), at least one of
    # max_model_len. A smaller cache only makes sequences wait (vLLM preempts and recomputes them). GPU
    # engines fill what gpu_memory_utilization leaves.
    kv_cache_tokens: int | None = pydantic.Field(default=None, ge=16)
    # per-request limits of the endpoint: tokens when a request names no max_tokens, and the largest `n`
    default_max_tokens: int = pydantic.Field(default=1024, ge=1)
    max_n: int = pydantic.Field(default=128, ge=1)
    # Store the run's served turns, and the feedback on them, for training (art_ray/feedback.py): every
    # completion of `name` or `name@step` without `"store": false`. None: nothing is stored.
    traffic: TrafficConfig | None = None
    # Release each new version to a share of the run's traffic first, compared with the stable one on its
    # stored turns' guardrails and feedback (art_ray/releases.py; needs `traffic`). None: `name` is the
    # newest version, as soon as it is trained.
    release: ReleasePolicy | None = None
    # capture sessions: the store's cap on recorded bytes, and an unused session's lifetime
    capture_max_bytes: int = pydantic.Field(default=256 * 2**20, ge=1)
    capture_ttl_s: float = pydantic.Field(default=3600.0, gt=0)
    # Responses API: the bytes of stored responses kept for `previous_response_id` (least recently used go)
    response_store_max_bytes: int = pydantic.Field(default=64 * 2**20, ge=1)
    keep_versions: int = pydantic.Field(default=3, ge=1)
    replica_cpus: float = pydantic.Field(default=1.0, ge=0)
    replica_gpus: float | None = None  # None: 1 per tensor-parallel rank on GPU (0.5 colocated), 0 on CPU
    replica_resources: dict[str, float] = pydantic.Field(default_factory=dict)
    # None: every core of the node when colocated on CPU, else the CPUs the replica reserves
    engine_threads: int | None = pydantic.Field(default=None, ge=1)
    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    gpu_memory_utilization: float = pydantic.Field(default=0.85, gt=0, le=1)
    # vLLM's tool parser (None: "hermes" for the local models, whose template renders Hermes tool calls;
    # tool calls stay plain text for other models unless set, e.g. "hermes" for Qwen2.5, "llama3_json").
    tool_call_parser: str | None = None
    chat_template: str | None = None
    # How far vLLM's tool-call grammar constrains a call (its --tool-strict-level). "parameter": the
    # arguments of a call match the tool's JSON schema whether or not the tool says `strict`; "function":
    # only the call's frame (a known tool name, JSON arguments of any shape) unless a tool says `strict`;
    # "auto": vLLM's own default (the frame only for forced calls, nothing for tool_choice="auto"). Under
    # tool_choice="auto" the model may still answer in text at every level; once it opens a call, the level
    # applies. Measured with SmolLM2-135M: forced calls to non-strict tools matched their schema in 0 of 24
    # requests at "auto", which is why art-ray's default is "parameter".
    tool_strict_level: ToolStrictLevel = "parameter"
    # The longest run of whitespace a tool call's JSON may have between two tokens (xgrammar's
    # max_whitespace_cnt; None: any, vLLM's own). vLLM's call grammar allows any, and a small model sampling
    # a call could write whitespace until max_tokens (SmolLM2 at temperature 0.7, 1 of 24 email-agent
    # episodes). 4 keeps one level of pretty-printing ("\n  "); compact JSON, as templates render calls,
    # needs 1.
    tool_call_max_whitespace: int | None = pydantic.Field(default=4, ge=1)

    @property
    def replicas_at_start(self) -> int:
        return self.autoscaling.min_replicas if self.autoscaling else self.num_replicas

    @pydantic.model_validator(mode="after")
    def _release_reads_traffic(self) -> ModelConfig:
        if self.release is not None and self.traffic is None:
            raise ValueError("release compares versions on the run's stored turns: set traffic too")
        return self
