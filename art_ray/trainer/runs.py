"""Many LoRA runs on one trainer group: what they must share, and each run's state on a rank.

Runs whose trainer settings agree (`group_key`: the base model, the LoRA shape, the ranks' layout and
sizes) can train on one group, so the base weights are loaded once. Each rank holds every run's adapter,
optimizer state, step and RNG state; one run at a time is live in the DeepSpeed engine, and `RunStates`
swaps another in by copying its tensors into the engine's own (the adapter's parameters, the optimizer's
master weights and moments), in place: DeepSpeed's optimizer wrappers keep views of them. The runs that
wait are parked in host memory (pinned on GPU, host_memory.py), so a device holds one run's state
however many share it; a swap moves a LoRA's few MB. Nothing of a run's arithmetic depends on the other
runs: what goes live is exactly what the run left, and a fresh run starts from what a trainer of its own
would (its step-0 adapter, and on GPU the bf16 wrapper's initial optimizer step), so a run trains as it
would alone.

What may differ between runs of one group: name, project, seed (their step-0 adapters), the optimizer's
`adam_betas`, `adam_epsilon`, `weight_decay` (held in each run's param-group settings), `keep_versions`,
and every per-call setting (TrainConfig). Runs share at ZeRO stage 0 (the float32 CPU trainer, or bf16
on GPU with its fp32 masters); ZeRO's partitioned optimizers keep a group per run.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import pydantic

from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.host_memory import HostMemory

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


class ParkedRun:
    """A run's training state while another run is live, in host memory (see host_memory.py): its
    adapter, the optimizer's master weights (distinct tensors only under a mixed-precision wrapper), each
    master's optimizer state, the param groups' settings and the RNG. Fresh runs have no tensors yet."""

    def __init__(self, rng: list[torch.Tensor], settings: list[dict[str, Any]]) -> None:
        self.adapter: list[torch.Tensor] | None = None  # None: its step-0 adapter, made when it goes live
        self.masters: list[torch.Tensor] = []
        self.optimizer: list[dict[str, Any]] = []
        self.settings = settings  # the optimizer's param groups without their params
        self.rng = rng

    def nbytes(self) -> int:
        return _tensor_bytes([self.adapter, self.masters, self.optimizer])


class RunState:
    def __init__(self, config: TrainerConfig, parked: ParkedRun | None) -> None:
        self.config = config
        self.step = 0
        # while the run is live its parked copy is stale: kept so the next park reuses its buffers
        # (pinned allocations are slow), None until it is first parked
        self.parked = parked


def unswappable(engine: Any) -> str | None:
    """Why this engine's runs cannot be swapped (None: they can). The swap writes the adapter into the
    module's trainable parameters and the masters and moments into the basic (torch) optimizer; it knows
    the plain optimizer (float32) and the wrapper DeepSpeed puts around a torch optimizer in bf16 at ZeRO
    stage 0 (FP16_UnfusedOptimizer: one fp32 master per parameter, the basic optimizer's parameters).
    Other wrappers (ZeRO's partitions, flat master buffers) hold state this does not reach."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if engine.optimizer is engine.basic_optimizer or isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        return None
    return f"DeepSpeed's {type(engine.optimizer).__name__} is not swapped between runs"


class RunStates:
    """The runs a rank holds and which one is live in `engine` (a DeepSpeed engine around a PEFT model).

    Only the live run's state is in the engine (on its device); the others wait parked in `memory`, so a
    rank's device holds one run's optimizer state however many runs it trains."""

    def __init__(self, engine: Any, founder: TrainerConfig, memory: HostMemory) -> None:
        import torch

        self._engine = engine
        self._memory = memory
        self._why_not = unswappable(engine)
        optimizer = engine.basic_optimizer
        # the settings a fresh run's optimizer starts from (the founder's, before any call set its rate)
        self._initial_settings = _group_settings(optimizer)
        # every run's RNG starts from its seed when it first trains (the founder's too, after the setup's
        # draws), so a run draws the same numbers whichever run founded the group
        torch.manual_seed(founder.settings.seed)
        self._runs = {founder.model: RunState(founder, None)}
        self.live = founder.model

    def names(self) -> list[str]:
        return list(self._runs)

    def config(self, run: str) -> TrainerConfig:
        return self._runs[run].config

    def add(self, config: TrainerConfig) -> None:
        import torch

        if config.model in self._runs:
            raise ValueError(f"run {config.model!r} is already on this trainer")
        if self._why_not is not None:
            raise ValueError(f"runs cannot share this trainer: {self._why_not}")
        settings = [
            {
                **group,
                "betas": config.settings.adam_betas,
                "eps": config.settings.adam_epsilon,
                "weight_decay": config.settings.weight_decay,
            }
            for group in self._initial_settings
        ]
        live_rng = self._memory.rng_state()
        torch.manual_seed(config.settings.seed)
        rng = self._memory.rng_state()
        self._memory.set_rng_state(live_rng)
        self._runs[config.model] = RunState(config, ParkedRun(rng, copy.deepcopy(settings)))

    def remove(self, run: str) -> None:
        if run == self.live:
            raise ValueError(f"run {run!r} is live: activate another run first")
        del self._runs[run]

    def step(self, run: str) -> int:
        return self._runs[run].step

    def set_step(self, run: str, step: int) -> None:
        self._runs[run].step = step

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The live adapter's parameters, and the optimizer's masters where they are other tensors."""
        adapter = [p for p in self._engine.module.parameters() if p.requires_grad]
        masters = self._stepped()
        if len(masters) == len(adapter) and all(m is p for m, p in zip(masters, adapter, strict=True)):
            masters = []  # float32 without a wrapper: the optimizer steps the adapter itself
        return adapter, masters

    def _stepped(self) -> list[torch.Tensor]:
        """The tensors the basic optimizer steps, whose moments it keeps: the masters, or the adapter."""
        return [p for group in self._engine.basic_optimizer.param_groups for p in group["params"]]

    def _park_live(self, parked: ParkedRun | None) -> ParkedRun:
        """The live run's state copied out of the engine (into `parked`'s buffers where it has some)."""
        memory, optimizer = self._memory, self._engine.basic_optimizer
        adapter, masters = self._tensors()
        out = parked or ParkedRun([], [])
        previous = out.adapter or [None] * len(adapter)
        out.adapter = [memory.park(p.data, into) for p, into in zip(adapter, previous, strict=True)]
        previous_masters = out.masters or [None] * len(masters)
        out.masters = [memory.park(m.data, into) for m, into in zip(masters, previous_masters, strict=True)]
        stepped_tensors = self._stepped()
        previous_state = out.optimizer or [{} for _ in stepped_tensors]
        out.optimizer = [
            {
                key: _park_state(memory, value, into.get(key))
                for key, value in optimizer.state.get(stepped, {}).items()
            }
            for stepped, into in zip(stepped_tensors, previous_state, strict=True)
        ]
        out.settings = _group_settings(optimizer)
        out.rng = memory.rng_state()
        return out

    def _put_live(self, run: RunState, parked: ParkedRun) -> None:
        """`parked` written into the engine's tensors, in place."""
        from peft import set_peft_model_state_dict

        from art_ray.adapters.lora_files import initial_adapter

        memory, optimizer, engine = self._memory, self._engine.basic_optimizer, self._engine
        adapter, masters = self._tensors()
        for group, settings in zip(optimizer.param_groups, parked.settings, strict=True):
            group.update(copy.deepcopy(settings))
        if parked.adapter is None:  # a fresh run: what a trainer of its own would start from
            config = run.config
            set_peft_model_state_dict(
                engine.module, initial_adapter(config.base_model, config.settings.lora, config.settings.seed)
            )
            if masters:  # a mixed-precision wrapper's fp32 masters start as the adapter's values
                for master, param in zip(masters, adapter, strict=True):
                    master.data.copy_(param.data)
            optimizer.state.clear()
            if engine.optimizer is not optimizer and hasattr(engine.optimizer, "initialize_optimizer_states"):
                engine.optimizer.initialize_optimizer_states()  # as deepspeed.initialize did for the founder
        else:
            for param, saved in zip(adapter, parked.adapter, strict=True):
                memory.restore(param.data, saved)
            for master, saved in zip(masters, parked.masters, strict=True):
                memory.restore(master.data, saved)
            for stepped, saved in zip(self._stepped(), parked.optimizer, strict=True):
                live = optimizer.state.get(stepped, {})
                state: dict[str, Any] = {}
                for key, value in saved.items():
                    if not isinstance(value, ParkedTensor):
                        state[key] = copy.deepcopy(value)
                    elif value.fits(live.get(key)):
                        memory.restore(live[key], value.host)
                        state[key] = live[key]
                    else:
                        state[key] = memory.to_device(value.host, value.device)
                if state:
                    optimizer.state[stepped] = state
                else:
                    optimizer.state.pop(stepped, None)
        memory.set_rng_state(parked.rng)
        memory.settle()

    def activate(self, run: str) -> None:
        """Make `run` the live one: the live run's state is parked, `run`'s goes into the engine."""
        if run == self.live:
            return
        target = self._runs[run]  # KeyError for a run this rank does not hold
        assert target.parked is not None
        current = self._runs[self.live]
        current.parked = self._park_live(current.parked)
        self._put_live(target, target.parked)
        self.live = run

    def describe(self) -> list[RunStatus]:
        adapter, masters = self._tensors()
        live_bytes = _tensor_bytes([adapter, masters, list(self._engine.basic_optimizer.state.values())])
        return [
            RunStatus(
                model=name,
                project=run.config.project,
                step=run.step,
                live=name == self.live,
                state_bytes=live_bytes if name == self.live or run.parked is None else run.parked.nbytes(),
            )
            for name, run in self._runs.items()
        ]


class ParkedTensor(NamedTuple):
    """An optimizer state tensor in host memory, and the device it goes back to (torch keeps Adam's
    `step` on the host beside moments on the GPU)."""

    host: torch.Tensor
    device: torch.device

    def fits(self, live: Any) -> bool:
        """Whether `live` can take it back in place."""
        import torch

        return (
            isinstance(live, torch.Tensor)
            and live.device == self.device
            and (live.shape, live.dtype) == (self.host.shape, self.host.dtype)
        )


def _group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """A copy of each of the optimizer's param groups without its params."""
    return [
        {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]


def _park_state(memory: HostMemory, value: Any, into: Any) -> Any:
    """One optimizer state entry parked: a tensor into host memory (`into`'s buffer if it has one)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    buffer = into.host if isinstance(into, ParkedTensor) else None
    return ParkedTensor(memory.park(value, buffer), value.device)
