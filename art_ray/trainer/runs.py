"""Many LoRA runs on one trainer group: what they must share, and each run's state on a rank.

Runs whose trainer settings agree (`group_key`: the base model, the LoRA shape, the ranks' layout and
sizes) can train on one group, so the base weights are loaded once. Each rank holds every run's adapter,
optimizer state, step and RNG state; one run at a time is live in the DeepSpeed engine, and `RunStates`
swaps another in by copying its tensors into the adapter's parameters and its state into the optimizer
(milliseconds for a LoRA). Nothing of a run's arithmetic depends on the other runs: what goes live is
exactly what the run left, so a run trains as it would alone.

What may differ between runs of one group: name, project, seed (their step-0 adapters), the optimizer's
`adam_betas`, `adam_epsilon`, `weight_decay` (held in each run's optimizer state), `keep_versions`, and
every per-call setting (TrainConfig). Swapping needs the engine's optimizer to be the plain torch one:
ZeRO stage 0 in float32, which is the CPU trainer; a GPU trainer (bf16, DeepSpeed's own optimizer wrapper
with fp32 master weights) keeps a group per run until its swap is written.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

import pydantic

from art_ray.trainer.config import TrainerConfig

if TYPE_CHECKING:
    import torch

# ModelConfig fields that must agree for runs to share a group (the rest are each run's own or serving's)
GROUP_SETTINGS = {
    "lora",
    "world_size",
    "zero_stage",
    "sequence_length",
    "micro_batch_rows",
    "trainer_cpus_per_rank",
    "trainer_gpus_per_rank",
    "trainer_threads",
    "trainer_resources",
    "layout",
    "device",
}


def group_key(config: TrainerConfig) -> str:
    """Equal for configs whose runs can train on one group."""
    return json.dumps(
        {
            "base_model": config.base_model,
            "device": config.device,
            "rank": config.rank.model_dump(),
            "threads": config.threads,
            "colocated": config.colocated,
            "settings": config.settings.model_dump(include=GROUP_SETTINGS),
        },
        sort_keys=True,
    )


def shareable(config: TrainerConfig) -> str | None:
    """Why runs of this config cannot share a group (None: they can)."""
    if config.device != "cpu":
        return "a GPU trainer's optimizer state is not swapped between runs yet"
    if config.settings.zero_stage != 0:
        return (
            f"zero_stage {config.settings.zero_stage} partitions the optimizer state (runs share at stage 0)"
        )
    return None


class RunStatus(pydantic.BaseModel):
    """A run on a trainer's ranks, as `art-ray status` lists it."""

    model: str
    project: str
    step: int
    live: bool  # its state is the one in the engine now
    state_bytes: int  # its adapter and optimizer state on one rank


def _tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a (nested) state dict."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


class RunState:
    """One run's training state on a rank while another run is live (all None while it is live)."""

    def __init__(
        self, config: TrainerConfig, rng: torch.Tensor | None = None, optimizer: dict[str, Any] | None = None
    ) -> None:
        self.config = config
        self.step = 0
        self.adapter: dict[str, torch.Tensor] | None = None  # None: its step-0 adapter, made on first use
        self.optimizer: dict[str, Any] | None = optimizer
        self.rng: torch.Tensor | None = rng


class RunStates:
    """The runs a rank holds and which one is live in `engine` (a DeepSpeed engine around a PEFT model)."""

    def __init__(self, engine: Any, founder: TrainerConfig) -> None:
        import torch

        self._engine = engine
        # a fresh run's optimizer state: no moments yet, the founder's param groups with the run's settings
        # (None where runs cannot share: DeepSpeed's optimizer wrappers hold views no copy can take)
        self._fresh_optimizer = (
            copy.deepcopy(engine.optimizer.state_dict()) if shareable(founder) is None else None
        )
        # every run's RNG starts from its seed when it first trains (the founder's too, after the setup's
        # draws), so a run draws the same numbers whichever run founded the group
        torch.manual_seed(founder.settings.seed)
        self._runs = {founder.model: RunState(founder)}
        self.live = founder.model

    def names(self) -> list[str]:
        return list(self._runs)

    def config(self, run: str) -> TrainerConfig:
        return self._runs[run].config

    def add(self, config: TrainerConfig) -> None:
        import torch

        if config.model in self._runs:
            raise ValueError(f"run {config.model!r} is already on this trainer")
        if self._fresh_optimizer is None:
            raise ValueError(f"runs cannot share this trainer: {shareable(self.config(self.live))}")
        optimizer = copy.deepcopy(self._fresh_optimizer)
        for group in optimizer["param_groups"]:
            group.update(
                betas=config.settings.adam_betas,
                eps=config.settings.adam_epsilon,
                weight_decay=config.settings.weight_decay,
            )
        live_rng = torch.get_rng_state()
        torch.manual_seed(config.settings.seed)
        self._runs[config.model] = RunState(config, torch.get_rng_state(), optimizer)
        torch.set_rng_state(live_rng)

    def remove(self, run: str) -> None:
        if run == self.live:
            raise ValueError(f"run {run!r} is live: activate another run first")
        del self._runs[run]

    def step(self, run: str) -> int:
        return self._runs[run].step

    def set_step(self, run: str, step: int) -> None:
        self._runs[run].step = step

    def activate(self, run: str) -> None:
        """Make `run` the live one: the live run's state is put aside, `run`'s goes into the engine."""
        import torch
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        from art_ray.adapters.lora_files import initial_adapter

        if run == self.live:
            return
        target = self._runs[run]  # KeyError for a run this rank does not hold
        current = self._runs[self.live]
        module = self._engine.module
        current.adapter = {
            name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(module).items()
        }
        current.optimizer = copy.deepcopy(self._engine.optimizer.state_dict())
        current.rng = torch.get_rng_state()
        config = target.config
        adapter = target.adapter
        if adapter is None:
            adapter = initial_adapter(config.base_model, config.settings.lora, config.settings.seed)
        set_peft_model_state_dict(module, adapter)
        assert target.optimizer is not None and target.rng is not None
        self._engine.optimizer.load_state_dict(target.optimizer)
        torch.set_rng_state(target.rng)
        target.adapter = target.optimizer = target.rng = None
        self.live = run

    def describe(self) -> list[RunStatus]:
        live_bytes = _tensor_bytes(
            [p for p in self._engine.module.parameters() if p.requires_grad]
        ) + _tensor_bytes(self._engine.optimizer.state_dict()["state"])
        return [
            RunStatus(
                model=name,
                project=run.config.project,
                step=run.step,
                live=name == self.live,
                state_bytes=live_bytes
                if name == self.live
                else _tensor_bytes([run.adapter, (run.optimizer or {}).get("state")]),
            )
            for name, run in self._runs.items()
        ]
