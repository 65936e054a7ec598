"""ARTBackend: OpenPipe ART 0.5's `art.Backend` protocol on art-ray. An ART script written for ART's
LocalBackend runs on a Ray cluster by changing the line that builds the backend:

    backend = art_ray.ARTBackend()          # was: backend = LocalBackend()

It drives an art-ray backend (a RayBackend by default, or an HTTPBackend) through art-ray's own verbs:
ART's models get an art-ray twin (same name and project), ART's trajectory groups cross into art-ray's
types through their wire form (their choices stay the openai `Choice` objects the endpoint returned), and
ART's train kwargs map onto art-ray's TrainConfig, where a kwarg art-ray does not implement raises
`UnsupportedTrainArgumentError` before anything trains. ART's own files (history.jsonl, state.json,
its Parquet) go under `{storage}/.art` for local storage (ART writes them with local file IO), beside
art-ray's checkpoints and MLflow store.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import art
from art.types import LocalTrainResult, TrainSFTConfig

from art_ray.errors import ArtRayError, BackendError
from art_ray.model import TrainableModel
from art_ray.model_config import ModelConfig
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.train_result import GradientStep, TrainResult
from art_ray.trajectories import History, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_ray.backend_protocol import Backend


def _undo_arts_transformers_patch() -> None:
    """`import art` (0.5.18) wraps transformers' masking_utils._preprocess_mask_arguments for the
    signature of transformers 5.2, which ART pins in its backend extra (a `cache_position` argument later
    releases dropped): with the transformers art-ray installs, every forward pass of a model in this
    process then raises TypeError. art-ray never needs the wrapper (ART's own trainer is not used), so
    the original ART saved goes back where it no longer fits."""
    try:
        import inspect

        from art.transformers import patches
        from transformers import masking_utils
    except ImportError:
        return
    original = patches._preprocess_mask_arguments
    wrapped = inspect.signature(patches._patched_preprocess_mask_arguments).parameters
    if (
        masking_utils._preprocess_mask_arguments is patches._patched_preprocess_mask_arguments
        and list(wrapped) != list(inspect.signature(original).parameters)[: len(wrapped)]
    ):
        masking_utils._preprocess_mask_arguments = original


_undo_arts_transformers_patch()

# ART's LocalBackend.train kwargs that art-ray does not implement, with ART's default: passing the default
# is fine (nothing changes), any other value raises.
UNSUPPORTED_AT_DEFAULT: dict[str, Any] = {
    "loss_fn_config": None,
    "adam_params": None,
    "kl_penalty_reference_step": None,
    "kl_ref_adapter_path": None,
    "advantage_balance": 0.0,
    "max_negative_advantage_importance_sampling_weight": None,
    "mask_prob_ratio": False,
    "kimi_k2_tau": None,
    "plot_tensors": False,
    "scale_learning_rate_by_reward_std_dev": False,
    "logprob_calculation_chunk_size": 1024,
    "num_trajectories_learning_rate_multiplier_power": 0.0,
}
# CISPO's clip range in ART (loss.py): [1 - 1.0, 1 + 4.0]; PPO's: [1 - 0.2, 1 + 0.2]
ART_EPSILON = {"cispo": (1.0, 4.0), "ppo": (0.2, None)}


class UnsupportedTrainArgumentError(ArtRayError, TypeError):
    """An ART train kwarg (or value) art-ray does not implement; nothing was trained."""


def train_config_from_art(kwargs: dict[str, Any]) -> tuple[TrainConfig, bool]:
    """ART's `backend.train` kwargs as art-ray's TrainConfig, and whether the caller asked for a
    checkpoint path (ART's `save_checkpoint`). Raises UnsupportedTrainArgumentError naming the kwarg."""
    given = dict(kwargs)
    for name, default in UNSUPPORTED_AT_DEFAULT.items():
        if name in given and given.pop(name) != default:
            raise UnsupportedTrainArgumentError(
                f"ART train argument {name!r}={kwargs[name]!r} is not supported by art-ray (only its default "
                f"{default!r}); nothing was trained"
            )
    loss_fn = given.pop("loss_fn", "cispo")
    if loss_fn not in ART_EPSILON:
        raise UnsupportedTrainArgumentError(f"loss_fn={loss_fn!r}: art-ray implements 'cispo' and 'ppo'")
    level = given.pop("importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        raise UnsupportedTrainArgumentError(
            f"importance_sampling_level={level!r}: art-ray implements 'token' and 'sequence'"
        )
    epsilon, epsilon_high = ART_EPSILON[loss_fn]
    epsilon = given.pop("epsilon", None) or epsilon
    epsilon_high = given.pop("epsilon_high", None) or epsilon_high
    # ART: normalize_advantages=False turns reward scaling off whatever scale_rewards says
    normalize = given.pop("normalize_advantages", True)
    scale_rewards = given.pop("scale_rewards", True) and normalize
    save_checkpoint = bool(given.pop("save_checkpoint", True))
    given.pop("verbose", None)
    fields = {
        name: given.pop(name)
        for name in (
            "learning_rate",
            "kl_penalty_coef",
            "truncated_importance_sampling",
            "packed_sequence_length",
            "allow_training_without_logprobs",
            "precalculate_logprobs",
        )
        if name in given
    }
    if given:
        raise UnsupportedTrainArgumentError(
            f"unknown ART train argument(s) {sorted(given)}; nothing was trained"
        )
    config = TrainConfig(
        policy_loss=loss_fn,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        scale_rewards=scale_rewards,
        importance_sampling_level=level,
        **fields,
    )
    return config, save_checkpoint


def trajectory_from_art(trajectory: art.Trajectory) -> Trajectory:
    """An ART Trajectory through its wire form; its choices stay the openai objects (and their token ids)."""
    data = trajectory.model_dump(exclude={"messages_and_choices", "additional_histories"})
    return Trajectory.model_validate(
        {
            **data,
            "messages_and_choices": list(trajectory.messages_and_choices),
            "additional_histories": [
                History(messages_and_choices=list(history.messages_and_choices), tools=history.tools)
                for history in trajectory.additional_histories
            ],
        }
    )


def trajectory_to_art(trajectory: Trajectory) -> art.Trajectory:
    """The reverse of trajectory_from_art (e.g. a capture session's trajectory for an ART script)."""
    data = trajectory.model_dump(exclude={"messages_and_choices", "additional_histories"})
    return art.Trajectory.model_validate(
        {
            **data,
            "messages_and_choices": list(trajectory.messages_and_choices),
            "additional_histories": [
                art.trajectories.History(messages_and_choices=list(h.messages_and_choices), tools=h.tools)
                for h in trajectory.additional_histories
            ],
        }
    )


def group_from_art(group: art.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup(
        [trajectory_from_art(trajectory) for trajectory in group.trajectories],
        metadata=dict(group.metadata),
        exceptions=[exception.model_dump() for exception in group.exceptions],
        metrics=dict(group.metrics),
        logs=list(group.logs),
    )


class ARTBackend:
    """`art.Backend` on art-ray. `backend`: the art-ray backend to drive (None: a RayBackend built from
    `ray_backend_kwargs`: address, storage, host, port, api_key, ...). `model_config`: the art-ray
    settings of the models registered here (ART's `_internal_config` engine/init/peft args override the
    matching ones)."""

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        model_config: ModelConfig | None = None,
        **ray_backend_kwargs: Any,
    ) -> None:
        if backend is None:
            from art_ray.backend import RayBackend

            backend = RayBackend(**ray_backend_kwargs)
        elif ray_backend_kwargs:
            raise TypeError(f"{sorted(ray_backend_kwargs)} configure a RayBackend: give them or a backend")
        self.backend = backend
        self.model_config = model_config or ModelConfig()
        self._twins: dict[str, TrainableModel] = {}
        self._steps: dict[str, int] = {}

    def _art_path(self) -> str:
        storage = getattr(self.backend, "storage", None)
        if storage is None or "://" in storage:
            return os.path.abspath(".art")
        return os.path.join(os.path.abspath(os.path.expanduser(storage)), ".art")

    def _twin(self, model: art.Model) -> TrainableModel:
        if model.name not in self._twins:
            raise BackendError(f"model {model.name!r} is not registered: await model.register(backend) first")
        return self._twins[model.name]

    async def register(self, model: art.Model) -> None:
        model.base_path = self._art_path()
        if not model.trainable:
            return
        twin = self._twins.get(model.name)
        if twin is None:
            twin = TrainableModel(
                name=model.name,
                project=model.project,
                base_model=model.base_model,
                config=model_config_from_art(self.model_config, getattr(model, "_internal_config", None)),
            )
            await twin.register(self.backend)
            self._twins[model.name] = twin
        self._steps[model.name] = await twin.get_step()

    async def _prepare_backend_for_training(
        self, model: art.TrainableModel, config: Any = None
    ) -> tuple[str, str]:
        if self.backend.base_url is None:
            raise BackendError(f"model {model.name!r} is not registered")
        return self.backend.base_url, self.backend.api_key or "art-ray"

    def _model_inference_name(self, model: art.Model, step: int | None = None) -> str:
        """`name@step`; without a step the newest trained one (as ART's LocalBackend)."""
        if not model.trainable:
            return model.inference_model_name or model.name
        return self._twin(model).get_inference_name(self._steps[model.name] if step is None else step)

    async def _get_step(self, model: art.TrainableModel) -> int:
        self._steps[model.name] = await self._twin(model).get_step()
        return self._steps[model.name]

    async def train(
        self, model: art.TrainableModel, trajectory_groups: Iterable[art.TrajectoryGroup], **kwargs: Any
    ) -> LocalTrainResult:
        """One step on the groups (ART's semantics: the step advances even when nothing is trainable);
        returns ART's TrainResult. Logging is the caller's (`model.log(groups, metrics=..., step=...)`)."""
        config, save_checkpoint = train_config_from_art(kwargs)
        twin = self._twin(model)
        groups = [group_from_art(group) for group in trajectory_groups]
        result = await self._final(self.backend.train(twin, groups, config))
        self._steps[model.name] = result.step
        return LocalTrainResult(
            step=result.step,
            metrics=result.metrics,
            checkpoint_path=result.checkpoint_path if save_checkpoint else None,
        )

    async def _train_sft(
        self,
        model: art.TrainableModel,
        trajectories: Iterable[art.Trajectory],
        config: TrainSFTConfig,
        dev_config: Any,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """SFT as one step: yields each optimizer step's metrics (ART averages and logs them)."""
        if dev_config:
            raise UnsupportedTrainArgumentError(
                f"ART's experimental SFT config {dict(dev_config)} is not supported"
            )
        converted = [trajectory_from_art(trajectory) for trajectory in trajectories]
        sft = SFTConfig(learning_rate=config.learning_rate, batch_size=config.batch_size)
        steps = len(sft.steps(len(converted)))
        async for event in self.backend.train_sft(self._twin(model), converted, sft):
            if isinstance(event, GradientStep):
                yield {**event.metrics, "data/step_num_gradient_steps": float(steps)}
            else:
                self._steps[model.name] = event.step

    async def _delete_checkpoint_files(self, model: art.TrainableModel, steps_to_keep: list[int]) -> None:
        await self.backend.delete_checkpoints(self._twin(model), steps_to_keep=steps_to_keep)

    async def close(self) -> None:
        self.backend.shutdown()

    async def __aenter__(self) -> ARTBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @staticmethod
    async def _final(events: AsyncIterator[Any]) -> TrainResult:
        result = None
        async for event in events:
            if isinstance(event, TrainResult):
                result = event
        if result is None:
            raise BackendError("the train call ended without a result")
        return result


def model_config_from_art(base: ModelConfig, internal: Any) -> ModelConfig:
    """`base`, with the settings of ART's `_internal_config` that art-ray has: init_args.max_seq_length,
    peft_args.r / lora_alpha, engine_args.max_model_len / gpu_memory_utilization / tensor_parallel_size.
    Others are named in a warning: ART's Unsloth and vLLM knobs have no art-ray meaning."""
    if not internal:
        return base
    update: dict[str, Any] = {}
    ignored = []
    for section, values in dict(internal).items():
        for key, value in (dict(values) if isinstance(values, dict) else {None: values}).items():
            match section, key:
                case "init_args", "max_seq_length":
                    update["sequence_length"] = value
                case "peft_args", "r":
                    update.setdefault("lora", {})["r"] = value
                case "peft_args", "lora_alpha":
                    update.setdefault("lora", {})["alpha"] = value
                case "engine_args", "max_model_len" | "gpu_memory_utilization" | "tensor_parallel_size":
                    update[key] = value
                case _:
                    ignored.append(section if key is None else f"{section}.{key}")
    if ignored:
        print(
            f"art-ray: ART _internal_config settings without an art-ray meaning, not applied: {ignored}",
            file=sys.stderr,
        )
    data = base.model_dump()
    data["lora"] = {**data["lora"], **update.pop("lora", {})}
    return ModelConfig.model_validate({**data, **update})
