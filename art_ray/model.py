"""Models with ART's verbs: `Model` (any OpenAI-compatible endpoint, for comparisons) and
`TrainableModel` (served and trained by a backend)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import httpx
import pydantic
from tqdm.auto import tqdm

from art_ray.adapters.spec import validate_model_name, versioned_name
from art_ray.batch_check import check_train_groups, choices_without_sampling_params, warn_unrecorded_sampling
from art_ray.feedback import Feedback, FeedbackRecord, FeedbackSource
from art_ray.model_config import ModelConfig
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainEvent, TrainResult
from art_ray.trajectories import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from art_ray.backend_protocol import Backend
    from art_ray.capture.session import CaptureSession
    from art_ray.releases import ReleaseState, ReleaseVerb
    from art_ray.tracking import Tracker
    from art_ray.traffic.records import MaturedTraffic, TrafficCursor, TrafficSnapshot

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, AsyncOpenAI]] = (
    weakref.WeakKeyDictionary()
)


def shared_client(base_url: str | None, api_key: str | None, deployment: str | None = None) -> AsyncOpenAI:
    """One client per (event loop, endpoint, key, deployment) in this process; also in remote rollout
    workers, where every call brings its own copy of the model. With `deployment` every request asks for
    that deployment (art_ray/deployment.py): another one on the same port answers 421, never a sample."""

    from openai import AsyncOpenAI

    from art_ray.deployment import deployment_headers

    def new() -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "unused",
            max_retries=2,
            timeout=1200,
            default_headers=deployment_headers(deployment),
        )

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # made outside a loop: it binds to whichever loop first uses it
        return new()
    clients = _CLIENTS.setdefault(loop, {})
    key = (base_url, api_key, deployment)
    if key not in clients:
        clients[key] = new()
    return clients[key]


class Model(pydantic.BaseModel):
    """A prompted model behind any OpenAI-compatible endpoint (e.g. a hosted baseline)."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    name: str
    project: str
    inference_model_name: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    # the identity of the deployment that serves it (a registered model's, from its backend): its clients
    # send it, so that another deployment listening on the same port refuses their requests
    deployment: str | None = None

    def openai_client(self) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint, shared per event loop (as ART does):
        rollouts call this once each, and a client per call would open a connection pool per rollout."""
        return shared_client(self.base_url, self.api_key, self.deployment)

    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_model_name or self.name

    def capture(self, ttl_s: float | None = None) -> AbstractAsyncContextManager[CaptureSession]:
        """`async with model.capture() as session:` the endpoint records every chat completion made through
        `session.base_url` (any client or framework); `await session.trajectory(reward=...)` returns them
        as a trainable Trajectory (art_ray/capture/session.py)."""
        from art_ray.capture.session import capture_session

        return capture_session(self, ttl_s)

    async def feedback(
        self,
        completion_id: str | None = None,
        *,
        score: float,
        comment: str | None = None,
        source: FeedbackSource = "user",
        feedback_id: str | None = None,
        session_id: str | None = None,
        token: str | None = None,
    ) -> FeedbackRecord:
        """Score a stored turn of this model (ModelConfig.traffic) by its completion id (the response's
        `id`, a Responses `resp_` id too) or its capture session's latest turn; a retry with the same
        `feedback_id` is stored once. With the response's `token` (its X-Art-Ray-Feedback-Token), a
        score for a stream still being sent waits for its turn. FeedbackError (`.status` 404) when no
        such turn is stored for this key; ValueError on a malformed score or id, before anything is
        sent."""
        import openai

        from art_ray.errors import FeedbackError

        body = Feedback(
            completion_id=completion_id,
            session_id=session_id,
            model=self.name,
            score=score,
            comment=comment,
            source=source,
            feedback_id=feedback_id,
            token=token,
        )
        try:
            response = await self.openai_client().post(
                "/feedback", body=body.model_dump(exclude_none=True), cast_to=httpx.Response
            )
        except openai.APIStatusError as error:
            message = (error.body or {}).get("message") if isinstance(error.body, dict) else None
            raise FeedbackError(error.status_code, message or str(error)) from None
        return FeedbackRecord.model_validate_json(response.content)


class TrainableModel(Model):
    """A LoRA on `base_model`, served as `name` / `name@step` and trained with GRPO."""

    base_model: str
    config: ModelConfig = pydantic.Field(default_factory=ModelConfig)
    tracking_uri: str | None = None
    _backend: Backend | None = pydantic.PrivateAttr(default=None)
    _told_unrecorded_sampling: bool = pydantic.PrivateAttr(default=False)

    @pydantic.field_validator("name", "project")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_model_name(value)

    async def register(self, backend: Backend) -> None:
        """Start serving and training this model on `backend` (resumes from its latest checkpoint)."""
        await backend.register(self)
        self._backend = backend
        self.base_url = backend.base_url
        self.api_key = backend.api_key
        self.deployment = getattr(backend, "deployment", None)  # a backend of another kind may know none

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"model {self.name!r} is not registered: await model.register(backend) first")
        return self._backend

    @property
    def tracker(self) -> Tracker:
        """The model's MLflow run (a RayBackend's; with an HTTPBackend the server tracks)."""
        return self.backend.tracker(self)

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else versioned_name(self.name, step)

    def __getstate__(self) -> dict[str, Any]:
        # Shipped to remote rollouts: the name, endpoint and key travel; the backend (actor handles)
        # and the MLflow client stay on the driver.
        state = super().__getstate__()
        state["__pydantic_private__"] = {"_backend": None}
        return state

    async def get_step(self) -> int:
        return await self.backend.get_step(self)

    async def traffic(self) -> TrafficSnapshot:
        """The turns the endpoint stored of this model and the feedback on them (ModelConfig.traffic),
        oldest first: completion ids, choices with their token ids, logprobs, sampling parameters and
        policy versions."""
        return await self.backend.traffic(self)

    async def release(
        self, action: ReleaseVerb = "status", step: int | None = None, reason: str = ""
    ) -> ReleaseState:
        """The run's release (ModelConfig.release) and the evidence per served step; or move it: "start"
        a canary of `step` (default: the newest published), "check" it against the stable step (roll
        back, advance a stage, promote, or wait), "promote" or "rollback" by hand, "pause" (every request
        to the stable step), "resume". A rollback takes effect on every replica when this returns."""
        from art_ray.releases import ReleaseAction

        return await self.backend.release(self, ReleaseAction(action=action, step=step, reason=reason))

    async def matured_traffic(self, after: TrafficCursor | None = None, limit: int = 256) -> MaturedTraffic:
        """Stored turns that feedback has labeled, in the order their first feedback came, past `after`
        (the cursor of the last batch taken), up to `limit`; and how many turns are labeled, unlabeled
        (no feedback within TrafficConfig.mature_after_s) and still waiting. OnlineTrainer's source."""
        return await self.backend.matured_traffic(self, after, limit)

    async def train_stream(
        self, groups: list[TrajectoryGroup], config: TrainConfig | None = None
    ) -> AsyncIterator[TrainEvent]:
        """Train one step, yielding each GradientStep as it finishes, then the TrainResult (the new step,
        served by every replica by then)."""
        config = config or TrainConfig()
        self._check_train_groups(groups, config)
        async for event in self.backend.train(self, groups, config):
            yield event

    async def train(
        self, groups: list[TrajectoryGroup], config: TrainConfig | None = None, verbose: bool = True
    ) -> int:
        """Train one step on the groups; returns the new step (served by every replica on return).
        Each gradient step's metrics are in `model.last_train_metrics`, the call's TrainResult in
        `model.last_train_result`, and both in MLflow."""
        config = config or TrainConfig()
        # train_stream's check, made here so that its warning names the caller's line
        self._check_train_groups(groups, config)
        return await self._consume(self.backend.train(self, groups, config), "train", verbose)

    def _check_train_groups(self, groups: list[TrajectoryGroup], config: TrainConfig) -> None:
        check_train_groups(groups, plain_assistant_trains=config.allow_training_without_logprobs)
        if not self._told_unrecorded_sampling and (count := choices_without_sampling_params(groups)):
            self._told_unrecorded_sampling = True
            warn_unrecorded_sampling(self.name, count)

    async def _consume(self, events: AsyncIterator[TrainEvent], desc: str, verbose: bool) -> int:
        bar = tqdm(desc=desc, disable=not verbose)
        gradient_steps: list[dict[str, float]] = []
        result: TrainResult | None = None
        async for event in events:
            if isinstance(event, GradientStep):
                gradient_steps.append(event.metrics)
                bar.set_postfix(
                    loss=event.metrics.get("loss/train"), grad_norm=event.metrics.get("loss/grad_norm")
                )
                bar.update(1)
            else:
                result = event
        bar.close()
        if result is None:
            raise RuntimeError(f"the {desc} call of {self.name!r} ended without a result")
        self.last_train_metrics = gradient_steps
        self.last_train_result = result
        return result.step

    async def train_sft(
        self, trajectories: list[Trajectory], config: SFTConfig | None = None, verbose: bool = True
    ) -> int:
        """Supervised fine-tuning as one step: cross-entropy on the trajectories' assistant turns (served
        choices or plain assistant messages), `config.batch_size` trajectories per optimizer step; the new
        step is served and checkpointed as after `train`. Returns the new step."""
        config = config or SFTConfig()
        return await self._consume(self.backend.train_sft(self, trajectories, config), "train_sft", verbose)

    # the last train call's gradient-step metrics, and its result (step, averaged metrics, checkpoint)
    last_train_metrics: list[dict[str, float]] = pydantic.Field(default_factory=list, exclude=True)
    last_train_result: TrainResult | None = pydantic.Field(default=None, exclude=True)

    async def log(
        self, groups: list[TrajectoryGroup], split: str = "val", metrics: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Log reward metrics of `groups` (and `metrics` as they are named) at the current step to MLflow,
        and save the groups as Parquet; returns what was logged."""
        return await self.backend.log(self, groups, split, metrics)

    async def delete_checkpoints(
        self, best_checkpoint_metric: str = "val/reward", steps_to_keep: list[int] | None = None
    ) -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric` (higher is
        better), or but `steps_to_keep`; returns the deleted steps."""
        return await self.backend.delete_checkpoints(self, best_checkpoint_metric, steps_to_keep)
