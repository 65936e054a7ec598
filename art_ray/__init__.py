"""art-ray: train LLM agents with reinforcement learning on Ray (an ART-compatible API).

`import art_ray` loads the SDK's types, configs and the HTTPBackend (pydantic, httpx), never torch, ray,
vllm, deepspeed, or openai until a Choice or a client is needed: a driver that trains through a training
server needs none of them. What needs Ray or pyarrow (RayBackend, remote_rollout, the Parquet helpers) is
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from art_ray.access import AccessError, KeyGrant
from art_ray.adapters.spec import LoRASpec
from art_ray.backend_protocol import Backend
from art_ray.capture.session import CaptureSession
from art_ray.dataset import DatasetBatch, iterate_dataset
from art_ray.errors import (
    ArtRayError,
    BackendError,
    CaptureError,
    FeedbackError,
    MissingTokenDataError,
    ModelPreparationError,
    QuotaExceededError,
    ReleaseError,
)
from art_ray.feedback import Feedback, FeedbackRecord, TrafficConfig
from art_ray.gather import TooManyExceptionsError, gather_trajectory_groups
from art_ray.model import Model, TrainableModel
from art_ray.model_config import ModelConfig
from art_ray.pipeline import PipelineTrainer, StepReport
from art_ray.placement import PlacementError
from art_ray.releases import Decision, Release, ReleasePolicy, ReleaseState
from art_ray.remote.client import HTTPBackend, RemoteTrainingError
from art_ray.sampling import SamplingParams
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainResult
from art_ray.trajectories import (
    History,
    PydanticException,
    SampledTokens,
    Trajectory,
    TrajectoryGroup,
    get_messages,
    sampled_tokens,
)

if TYPE_CHECKING:
    from art_ray.art_backend import ARTBackend, UnsupportedTrainArgumentError
    from art_ray.backend import RayBackend
    from art_ray.capture.session import capture_session
    from art_ray.parquet import read_trajectory_groups, write_trajectory_groups
    from art_ray.rollout_runner import captured_rollout, remote_rollout
    from art_ray.traffic.online import OnlineStep, OnlineTrainConfig, OnlineTrainer
    from art_ray.traffic.records import (
        LabeledTurn,
        MaturedTraffic,
        StoredTurn,
        TrafficCursor,
        TrafficSnapshot,
    )

_ON_FIRST_USE = {
    # needs openpipe-art (`pip install "art-ray[art]"`)
    "ARTBackend": "art_ray.art_backend",
    "UnsupportedTrainArgumentError": "art_ray.art_backend",
    "RayBackend": "art_ray.backend",
    "remote_rollout": "art_ray.rollout_runner",
    "captured_rollout": "art_ray.rollout_runner",
    "capture_session": "art_ray.capture.session",
    "read_trajectory_groups": "art_ray.parquet",
    "write_trajectory_groups": "art_ray.parquet",
    "StoredTurn": "art_ray.traffic.records",
    "TrafficSnapshot": "art_ray.traffic.records",
    "LabeledTurn": "art_ray.traffic.records",
    "MaturedTraffic": "art_ray.traffic.records",
    "TrafficCursor": "art_ray.traffic.records",
    "OnlineStep": "art_ray.traffic.online",
    "OnlineTrainConfig": "art_ray.traffic.online",
    "OnlineTrainer": "art_ray.traffic.online",
}


def __getattr__(name: str) -> Any:
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'art_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "PipelineTrainer",
    "StepReport",
    "ARTBackend",
    "SFTConfig",
    "UnsupportedTrainArgumentError",
    "AccessError",
    "KeyGrant",
    "ArtRayError",
    "BackendError",
    "CaptureError",
    "CaptureSession",
    "Feedback",
    "FeedbackError",
    "FeedbackRecord",
    "StoredTurn",
    "TrafficConfig",
    "TrafficSnapshot",
    "TrafficCursor",
    "LabeledTurn",
    "MaturedTraffic",
    "OnlineTrainer",
    "OnlineTrainConfig",
    "OnlineStep",
    "Release",
    "ReleasePolicy",
    "ReleaseState",
    "Decision",
    "ReleaseError",
    "DatasetBatch",
    "HTTPBackend",
    "LoRASpec",
    "Model",
    "ModelConfig",
    "PlacementError",
    "RayBackend",
    "RemoteTrainingError",
    "TooManyExceptionsError",
    "TrainableModel",
    "gather_trajectory_groups",
    "iterate_dataset",
    "remote_rollout",
    "captured_rollout",
    "capture_session",
    "History",
    "MissingTokenDataError",
    "ModelPreparationError",
    "QuotaExceededError",
    "PydanticException",
    "SampledTokens",
    "SamplingParams",
    "TrainConfig",
    "TrainResult",
    "GradientStep",
    "Backend",
    "Trajectory",
    "TrajectoryGroup",
    "get_messages",
    "read_trajectory_groups",
    "sampled_tokens",
    "write_trajectory_groups",
]
