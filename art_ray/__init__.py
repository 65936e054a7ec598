"""art-ray: train LLM agents with reinforcement learning on Ray (an ART-compatible API)."""

from art_ray.adapters.lora_files import LoRASpec
from art_ray.backend import BackendError, RayBackend
from art_ray.backend_protocol import Backend
from art_ray.dataset import DatasetBatch, iterate_dataset
from art_ray.errors import ArtRayError, MissingTokenDataError, ModelPreparationError
from art_ray.gather import TooManyExceptionsError, gather_trajectory_groups
from art_ray.model import Model, TrainableModel
from art_ray.model_config import ModelConfig
from art_ray.parquet import read_trajectory_groups, write_trajectory_groups
from art_ray.placement import PlacementError
from art_ray.remote.client import HTTPBackend, RemoteTrainingError
from art_ray.remote_rollout import remote_rollout
from art_ray.train_config import TrainConfig
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

__version__ = "0.1.0"

__all__ = [
    "ArtRayError",
    "BackendError",
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
    "History",
    "MissingTokenDataError",
    "ModelPreparationError",
    "PydanticException",
    "SampledTokens",
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
