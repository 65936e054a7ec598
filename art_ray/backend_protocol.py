"""The one seam between the SDK (`TrainableModel`) and what serves and trains it: RayBackend on a Ray
cluster, HTTPBackend through a training server. ART 0.5's `art.Backend` is the model; this one keeps
art-ray's verbs (`train` streams each gradient step, then the TrainResult)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from art_ray.model import TrainableModel
    from art_ray.releases import ReleaseAction, ReleaseState
    from art_ray.tracking import Tracker
    from art_ray.traffic.records import MaturedTraffic, TrafficCursor, TrafficSnapshot
    from art_ray.train_config import SFTConfig, TrainConfig
    from art_ray.train_result import TrainEvent
    from art_ray.trajectories import Trajectory, TrajectoryGroup


@runtime_checkable
class Backend(Protocol):
    """What a TrainableModel needs of whatever serves and trains it: RayBackend on a Ray cluster,
    HTTPBackend through a training server."""

    # the OpenAI-compatible endpoint the registered models are served at, and its key
    base_url: str | None
    api_key: str | None
    # that endpoint's identity (art_ray/deployment.py), which the models' clients ask for; None: unknown
    deployment: str | None

    async def register(self, model: TrainableModel) -> None: ...

    def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> AsyncIterator[TrainEvent]:
        """One step: a GradientStep per optimizer step as it finishes, then the TrainResult."""
        ...

    def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> AsyncIterator[TrainEvent]:
        """One supervised step on the trajectories' assistant turns, streamed as `train` is."""
        ...

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def traffic(self, model: TrainableModel) -> TrafficSnapshot:
        """The run's stored turns and the feedback on them (ModelConfig.traffic), oldest first."""
        ...

    async def matured_traffic(
        self, model: TrainableModel, after: TrafficCursor | None, limit: int
    ) -> MaturedTraffic:
        """The run's labeled turns whose first feedback came after `after`, in that order (up to
        `limit`), and its counts of labeled, unlabeled and waiting turns."""
        ...

    async def release(self, model: TrainableModel, action: ReleaseAction) -> ReleaseState:
        """Read or move the run's release (ModelConfig.release): start a canary, check it, promote,
        roll back, pause, resume."""
        ...

    async def delete_checkpoints(
        self,
        model: TrainableModel,
        best_checkpoint_metric: str = "val/reward",
        steps_to_keep: list[int] | None = None,
    ) -> list[int]:
        """Delete all checkpoints but `steps_to_keep` (or the latest and the best by the metric)."""
        ...

    async def delete_run(self, model: TrainableModel, purge_checkpoints: bool = False) -> None:
        """Stop training and serving the run: its names answer 404; its checkpoints stay unless purged."""
        ...

    def model_dir(self, model: TrainableModel) -> str: ...

    def tracker(self, model: TrainableModel) -> Tracker: ...

    def shutdown(self) -> None: ...
