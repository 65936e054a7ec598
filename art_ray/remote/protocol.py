"""The JSON of the training routes. Everything that crosses the wire is a pydantic model validated on
arrival (never pickle); errors use the OpenAI error shape the inference routes use.

Routes (under the training app's prefix, `/_art` by default), all POST with a JSON body:
- `/register` ModelSpec -> RegisterResponse
- `/train` TrainRequest -> newline-delimited JSON: one TrainStreamLine per gradient step, then one with
  the TrainResult; a failure after the stream started arrives as a line with `error`
- `/train_sft` TrainSFTRequest -> the same stream
- `/log` LogRequest -> LogResponse
- `/step` ModelRef -> StepResponse
- `/traffic` ModelRef -> TrafficSnapshot (art_ray/traffic/files.py: the run's stored turns and feedback)
- `/release` ReleaseRequest -> ReleaseState (art_ray/releases.py: read or move the run's release)
- `/matured_traffic` MaturedTrafficRequest -> MaturedTraffic (art_ray/traffic/matured.py: labeled turns)
- `/delete_checkpoints` DeleteCheckpointsRequest -> DeleteCheckpointsResponse
- `/delete_run` DeleteRunRequest -> DeleteRunResponse
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pydantic

from art_ray.adapters.spec import validate_model_name
from art_ray.model_config import ModelConfig
from art_ray.releases import ReleaseAction, ReleaseState
from art_ray.traffic.records import MaturedTraffic, TrafficCursor, TrafficSnapshot
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainResult
from art_ray.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_ray.model import TrainableModel

DEFAULT_ROUTE_PREFIX = "/_art"
SPLIT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
METRIC_NAME_PATTERN = re.compile(r"[/\w.\- :]{1,250}")  # MLflow's metric names


class _Message(pydantic.BaseModel):
    # NaN/inf metrics (a diverged loss) travel as JSON's NaN/Infinity rather than becoming null
    model_config = pydantic.ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class ModelSpec(_Message):
    """What the server needs to serve and train a TrainableModel (tracking stays on the server)."""

    name: str
    project: str
    base_model: str
    config: ModelConfig = pydantic.Field(default_factory=ModelConfig)

    @pydantic.field_validator("name", "project")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_model_name(value)

    @classmethod
    def of(cls, model: TrainableModel) -> ModelSpec:
        return cls(name=model.name, project=model.project, base_model=model.base_model, config=model.config)

    def trainable_model(self) -> TrainableModel:
        from art_ray.model import TrainableModel

        return TrainableModel(
            name=self.name, project=self.project, base_model=self.base_model, config=self.config
        )


class RegisterResponse(_Message):
    step: int
    # the OpenAI API's path on the same server (e.g. "/v1"): the client joins it to the URL it used
    inference_path: str
    model_dir: str
    tracking_uri: str | None
    # the inference app's identity (art_ray/deployment.py), which the model's clients ask for
    inference_deployment: str | None = None


class ModelRef(_Message):
    model: str


class ReleaseRequest(ModelRef):
    action: ReleaseAction = pydantic.Field(default_factory=ReleaseAction)


class MaturedTrafficRequest(ModelRef):
    after: TrafficCursor | None = None
    limit: int = pydantic.Field(default=256, ge=1, le=4096)


class TrainRequest(ModelRef):
    groups: list[TrajectoryGroup]
    config: TrainConfig = pydantic.Field(default_factory=TrainConfig)


class TrainSFTRequest(ModelRef):
    trajectories: list[Trajectory]
    config: SFTConfig = pydantic.Field(default_factory=SFTConfig)


class LogRequest(ModelRef):
    groups: list[TrajectoryGroup]
    split: str = "val"
    metrics: dict[str, float] = pydantic.Field(default_factory=dict)

    @pydantic.field_validator("metrics")
    @classmethod
    def _metric_names_mlflow_stores(cls, value: dict[str, float]) -> dict[str, float]:
        for name in value:
            if not METRIC_NAME_PATTERN.fullmatch(name):
                raise ValueError(
                    f"metric name {name!r}: 1-250 letters, digits, '_', '-', '.', ' ', ':' or '/' "
                    "(the names MLflow stores)"
                )
        return value

    @pydantic.field_validator("split")
    @classmethod
    def _split_is_a_folder_name(cls, value: str) -> str:
        if not SPLIT_PATTERN.fullmatch(value):
            raise ValueError("split must be 1-64 letters, digits, '-' or '_' (it names a folder)")
        return value


class LogResponse(_Message):
    metrics: dict[str, float]


class StepResponse(_Message):
    step: int


class DeleteCheckpointsRequest(ModelRef):
    best_checkpoint_metric: str = "val/reward"
    steps_to_keep: list[int] | None = None


class DeleteCheckpointsResponse(_Message):
    deleted: list[int]


class DeleteRunRequest(ModelRef):
    purge_checkpoints: bool = False


class DeleteRunResponse(_Message):
    model: str


class ErrorBody(_Message):
    message: str
    type: str
    param: str | None = None
    code: int


class TrainStreamLine(_Message):
    """One line of the /train stream: a `gradient_step`, the call's `result` (the last line), or an
    `error`."""

    gradient_step: GradientStep | None = None
    result: TrainResult | None = None
    error: ErrorBody | None = None


class Route(pydantic.BaseModel):
    """One training route: its body, its answer (each line's, for a stream) and what it does."""

    model_config = pydantic.ConfigDict(frozen=True)

    request: type[pydantic.BaseModel]
    response: type[pydantic.BaseModel]
    summary: str
    stream: bool = False


# The routes above, as the server serves them and its OpenAPI document (art_ray/remote/openapi.py) says.
ROUTES: dict[str, Route] = {
    "/register": Route(
        request=ModelSpec, response=RegisterResponse, summary="Register a model: serve it, make its trainer"
    ),
    "/train": Route(
        request=TrainRequest,
        response=TrainStreamLine,
        summary="One GRPO step on trajectory groups: a line per gradient step, then the result",
        stream=True,
    ),
    "/train_sft": Route(
        request=TrainSFTRequest,
        response=TrainStreamLine,
        summary="Supervised fine-tuning on trajectories: a line per gradient step, then the result",
        stream=True,
    ),
    "/log": Route(request=LogRequest, response=LogResponse, summary="Log trajectory groups and metrics"),
    "/step": Route(request=ModelRef, response=StepResponse, summary="The model's current step"),
    "/traffic": Route(
        request=ModelRef, response=TrafficSnapshot, summary="The run's stored turns and their feedback"
    ),
    "/release": Route(
        request=ReleaseRequest, response=ReleaseState, summary="Read or move the run's release"
    ),
    "/matured_traffic": Route(
        request=MaturedTrafficRequest,
        response=MaturedTraffic,
        summary="Labeled turns past a cursor, for training on traffic",
    ),
    "/delete_checkpoints": Route(
        request=DeleteCheckpointsRequest,
        response=DeleteCheckpointsResponse,
        summary="Delete checkpoints but the best and the latest (or those named)",
    ),
    "/delete_run": Route(
        request=DeleteRunRequest, response=DeleteRunResponse, summary="Stop serving and training a run"
    ),
}
