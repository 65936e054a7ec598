"""Trajectories: what a rollout produces and what the trainer consumes.

Field names follow OpenPipe ART so rollout code written for ART runs unchanged: the user appends plain
message dicts (context) and the `Choice` objects the OpenAI client returned (trainable) to
`messages_and_choices`. A choice that came from an art-ray endpoint carries the token ids the engine
sampled and their logprobs; the trainer trains on exactly those ids.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Iterable, Iterator
from contextlib import asynccontextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

import pydantic

from art_ray.errors import MissingTokenDataError
from art_ray.sampling import CHOICE_KEY, SamplingParams

if TYPE_CHECKING:
    from openai.types.chat.chat_completion import Choice

Message = dict[str, Any]
MessagesAndChoices = list[Any]  # each item a Message dict or an openai Choice (checked by the validator)
Tools = list[dict[str, Any]]
MetadataValue = float | int | str | bool | None

MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@cache
def _choice_type() -> type[Choice]:
    """openai's Choice, imported on first use: importing openai takes ~0.5 s, and a driver that only
    builds configs (or an HTTPBackend with dict messages) never needs it."""
    from openai.types.chat.chat_completion import Choice

    return Choice


def is_choice(item: Any) -> bool:
    return "openai" in sys.modules and isinstance(item, _choice_type())


def _looks_like_choice(item: Any) -> bool:
    # A serialized Choice has "message" and "index" keys and no "role"; a message always has "role".
    return isinstance(item, dict) and "role" not in item and "message" in item and "index" in item


def _validate_message(index: int, message: Message) -> None:
    role = message.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:  # a list or dict role is unhashable
        raise ValueError(
            f"messages_and_choices[{index}]: role must be one of {sorted(MESSAGE_ROLES)}, got {role!r}"
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise ValueError(
            f"messages_and_choices[{index}] ({role}): content must be a string, a list of content parts "
            f"or None, got {type(content).__name__}"
        )
    if content is None and role in ("system", "user", "developer"):
        raise ValueError(f"messages_and_choices[{index}] ({role}): content is required")
    if role == "tool" and not message.get("tool_call_id"):
        raise ValueError(f"messages_and_choices[{index}] (tool): tool_call_id is required")


def _coerce_messages_and_choices(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    coerced: list[Any] = []
    for index, item in enumerate(value):
        if is_choice(item):
            coerced.append(item)
        elif _looks_like_choice(item):
            coerced.append(_choice_type().model_validate(item))
        elif isinstance(item, dict):
            _validate_message(index, item)
            coerced.append(item)
        elif isinstance(item, pydantic.BaseModel) and hasattr(item, "role"):
            # openai message objects (e.g. ChatCompletionMessage) given as context
            message = item.model_dump(exclude_none=True)
            _validate_message(index, message)
            coerced.append(message)
        else:
            raise ValueError(
                f"messages_and_choices[{index}]: expected a message dict or an openai Choice, "
                f"got {type(item).__name__}"
            )
    return coerced


class SampledTokens(pydantic.BaseModel):
    """The tokens the engine sampled for one choice: what the trainer trains on. `sampling_params`: what
    they were drawn with (None: not recorded, as in trajectories of older versions, built by hand or by
    ART, which train at temperature 1)."""

    token_ids: list[int]
    logprobs: list[float]
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None

    @property
    def temperature(self) -> float:
        """The temperature the trainer computes these tokens' logprobs at."""
        return self.sampling_params.training_temperature if self.sampling_params is not None else 1.0


def choice_sampling_params(choice: Choice) -> SamplingParams | None:
    """The sampling parameters the endpoint recorded on a served choice, if it did."""
    recorded = (choice.model_extra or {}).get(CHOICE_KEY)
    if recorded is None:
        return None
    try:
        return SamplingParams.model_validate(recorded)
    except pydantic.ValidationError as error:
        raise MissingTokenDataError(f"choice has invalid {CHOICE_KEY}: {error}") from None


def _token_id_from_logprob_token(token: str) -> int | None:
    # vLLM's `return_tokens_as_token_ids` renders each token as "token_id:<id>".
    if token.startswith("token_id:"):
        try:
            return int(token.removeprefix("token_id:"))
        except ValueError:
            return None
    return None


def sampled_tokens(choice: Choice) -> SampledTokens:
    """Token ids and logprobs of a served choice; raises MissingTokenDataError if they are absent."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    if not content:
        raise MissingTokenDataError(
            "choice has no logprobs: request it from the art-ray endpoint (the SDK's client asks for "
            "logprobs and token ids) or pass logprobs=True"
        )
    logprobs = [entry.logprob for entry in content]
    extra = choice.model_extra or {}
    token_ids = extra.get("token_ids")
    if token_ids is None:
        parsed = [_token_id_from_logprob_token(entry.token) for entry in content]
        if any(token_id is None for token_id in parsed):
            raise MissingTokenDataError(
                "choice has logprobs but no token ids: ask the server for them "
                '(extra_body={"return_token_ids": True})'
            )
        token_ids = parsed
    if len(token_ids) != len(logprobs):
        raise MissingTokenDataError(f"choice has {len(token_ids)} token ids but {len(logprobs)} logprobs")
    for value in logprobs:
        if math.isnan(value):
            raise MissingTokenDataError("choice has a NaN logprob")
    return SampledTokens(
        token_ids=list(token_ids),
        logprobs=logprobs,
        prompt_token_ids=extra.get("prompt_token_ids"),
        sampling_params=choice_sampling_params(choice),
    )


def get_messages(messages_and_choices: MessagesAndChoices) -> list[Message]:
    """The conversation as plain message dicts (choices become assistant messages)."""
    messages: list[Message] = []
    for item in messages_and_choices:
        if is_choice(item):
            message: Message = {"role": "assistant", "content": item.message.content or ""}
            if item.message.tool_calls:
                message["tool_calls"] = [call.model_dump() for call in item.message.tool_calls]
            messages.append(message)
        else:
            messages.append(dict(item))
    return messages


class PydanticException(pydantic.BaseModel):
    """A rollout's exception as a TrajectoryGroup keeps it (`group.exceptions`): its type, message and
    traceback, serializable where the exception itself is not."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exception: BaseException) -> PydanticException:
        return cls(
            type=f"{type(exception).__module__}.{type(exception).__qualname__}",
            message=str(exception),
            traceback="".join(
                traceback.format_exception(type(exception), exception, exception.__traceback__)
            ),
        )


class _ConversationModel(pydantic.BaseModel):
    # validate_assignment: `trajectory.reward = nan` after construction fails there, not in training
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    messages_and_choices: MessagesAndChoices = pydantic.Field(default_factory=list)
    tools: Tools | None = None

    @pydantic.field_validator("messages_and_choices", mode="before")
    @classmethod
    def _check_messages(cls, value: Any) -> Any:
        return _coerce_messages_and_choices(value)

    def messages(self) -> list[Message]:
        return get_messages(self.messages_and_choices)

    def trainable_choices(self) -> list[Choice]:
        return [item for item in self.messages_and_choices if is_choice(item)]


class History(_ConversationModel):
    """Another conversation that belongs to a trajectory (a sub-agent, a judge): it shares its reward."""


class Trajectory(_ConversationModel):
    """One rollout: its conversation (`messages_and_choices`: messages as dicts and the endpoint's sampled
    `Choice`s, which hold the token ids and logprobs that train), tools, reward, metrics and metadata.
    `check_trainable()` raises MissingTokenDataError when a choice lacks its token data."""

    additional_histories: list[History] = pydantic.Field(default_factory=list)
    reward: float = 0.0
    # The policy versions (trained steps) that served this trajectory's first and last turn, as ART names
    # them; a trajectory sampled over a training step has final > initial. The trainer's staleness bound
    # reads the initial one.
    initial_policy_version: int | None = pydantic.Field(default=None, ge=0)
    final_policy_version: int | None = pydantic.Field(default=None, ge=0)
    metrics: dict[str, float | int | bool] = pydantic.Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = pydantic.Field(default_factory=dict)
    logs: list[str] = pydantic.Field(default_factory=list)
    start_time: float = pydantic.Field(default_factory=time.time, exclude=True)

    @pydantic.field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {value}")
        return value

    @pydantic.field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, value: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
        for name, metric in value.items():
            if isinstance(metric, float) and not math.isfinite(metric):
                raise ValueError(f"metric {name!r} must be finite, got {metric}")
        return value

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        self.metrics["duration"] = time.time() - self.start_time
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncGenerator[None, None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.metrics[f"{metric_name}_duration"] = time.monotonic() - start

    def histories(self) -> list[_ConversationModel]:
        """The main conversation first, then the additional histories."""
        return [self, *self.additional_histories]

    def stamp_policy_versions(self, initial: int | None = None, final: int | None = None) -> None:
        """Fill `initial_policy_version` / `final_policy_version` where unset: from the steps that sampled
        its served choices (the endpoint marks each with `policy_version`), else from `initial`/`final`
        (the versions the caller knew at the rollout's start and end: a client that streamed)."""
        versions = [
            version
            for history in self.histories()
            for choice in history.trainable_choices()
            if (version := (choice.model_extra or {}).get("policy_version")) is not None
        ]
        if self.initial_policy_version is None:
            self.initial_policy_version = min(versions) if versions else initial
        if self.final_policy_version is None:
            self.final_policy_version = max(versions) if versions else final

    def check_trainable(self) -> None:
        """Raise MissingTokenDataError unless every served choice carries token ids and logprobs."""
        for history_index, history in enumerate(self.histories()):
            for choice in history.trainable_choices():
                try:
                    sampled_tokens(choice)
                except MissingTokenDataError as error:
                    where = (
                        "trajectory" if history_index == 0 else f"additional_histories[{history_index - 1}]"
                    )
                    raise MissingTokenDataError(f"{where}: {error}") from None


def _check_iterable(field: str, value: Any) -> None:
    """A group's list fields take lists or iterators; a string, a mapping or a number is a caller's (or a
    request body's) mistake, said as a validation error rather than iterated or crashed on."""
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        raise ValueError(f"TrajectoryGroup.{field} must be a list, not {type(value).__name__}")


class TrajectoryGroup(pydantic.BaseModel):
    """Trajectories for the same scenario; GRPO compares rewards within a group.

    `baseline`: the reward each trajectory is compared with instead of the group's mean (advantage =
    reward - baseline, not divided by a std), so that one trajectory alone can train. Groups made from
    served traffic (art_ray/traffic/groups.py) carry a running mean of their task's rewards: production
    prompts rarely repeat, and a group of one has no mean to compare with."""

    trajectories: list[Trajectory] = pydantic.Field(default_factory=list)
    metadata: dict[str, MetadataValue] = pydantic.Field(default_factory=dict)
    baseline: float | None = None
    exceptions: list[PydanticException] = pydantic.Field(default_factory=list)
    metrics: dict[str, float | int | bool] = pydantic.Field(default_factory=dict)
    logs: list[str] = pydantic.Field(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | dict[str, Any]] = (),
        *,
        metadata: dict[str, MetadataValue] | None = None,
        exceptions: Iterable[BaseException | PydanticException | dict[str, Any]] = (),
        **data: Any,
    ) -> None:
        if not isinstance(trajectories, list | tuple) and "trajectories" in self.__dict__:
            return  # __new__ already built the group from this iterator, which is now consumed
        _check_iterable("exceptions", exceptions)
        items = list(trajectories)
        found = [item for item in items if isinstance(item, BaseException)]
        recorded = [
            PydanticException.from_exception(item) if isinstance(item, BaseException) else item
            for item in [*found, *exceptions]
        ]
        super().__init__(
            trajectories=[item for item in items if not isinstance(item, BaseException)],
            metadata=metadata or {},
            exceptions=recorded,
            **data,
        )

    def __new__(cls, trajectories: Iterable[Any] = (), **kwargs: Any) -> Any:
        # ART lets a group be built from rollout coroutines and then awaited.
        _check_iterable("trajectories", trajectories)
        items = trajectories if isinstance(trajectories, list | tuple) else list(trajectories)
        if any(isinstance(item, Awaitable) for item in items):
            return PendingTrajectoryGroup(list(items), **kwargs)
        group = super().__new__(cls)
        if items is not trajectories:  # an iterator: build now, while its items are at hand
            group.__init__(list(items), **kwargs)
        return group

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [trajectory.reward for trajectory in self.trajectories]

    @property
    def has_signal(self) -> bool:
        """Whether some trajectory has an advantage: rewards that differ, or one off the baseline."""
        rewards = self.rewards
        if self.baseline is not None:
            return any(abs(reward - self.baseline) > 1e-12 for reward in rewards)
        return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-12


class PendingTrajectoryGroup:
    """A TrajectoryGroup whose rollouts are still running: `await` it to get the group."""

    def __init__(
        self,
        rollouts: list[Awaitable[Trajectory]],
        *,
        metadata: dict[str, MetadataValue] | None = None,
        exceptions: Iterable[BaseException] = (),
    ) -> None:
        self.rollouts = rollouts
        self.metadata = metadata or {}
        self.exceptions = list(exceptions)

    def __len__(self) -> int:
        return len(self.rollouts)

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._gather().__await__()

    async def _gather(self) -> TrajectoryGroup:
        results = await asyncio.gather(*self.rollouts, return_exceptions=True)
        trajectories = [result for result in results if isinstance(result, Trajectory)]
        failures = [result for result in results if isinstance(result, BaseException)]
        return TrajectoryGroup(trajectories, metadata=self.metadata, exceptions=[*self.exceptions, *failures])
