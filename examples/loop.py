"""The training loop the agent examples share: baseline evaluation, GRPO steps, evaluation, a table.

An example supplies a rollout `(model, scenario, temperature) -> Trajectory`, its training and held-out
scenarios, and the trajectory metrics to print; the loop does the rest the way examples/one_word does:
register, evaluate before, gather groups (rollouts as Ray work), train, evaluate after each step, log to
MLflow, and print one JSON line at the end. With `--server URL` the same loop trains through a remote
training server (HTTPBackend) instead of Ray. Copy it into your project as a starting point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
import ray
from openai.types.chat.chat_completion import Choice

import art_ray
from art_ray import HTTPBackend, LoRASpec, ModelConfig, RayBackend, TrainableModel, TrainConfig, Trajectory

Rollout = Callable[[TrainableModel, Any, float], Awaitable[Trajectory]]

# Rollouts that call the helpers below run on Ray workers, which have the example's own folder on their
# path (art-ray submit) but not examples/: the helpers travel by value with the rollout function.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class AgentTask:
    name: str
    rollout: Rollout  # decorated with @art_ray.remote_rollout to run as Ray work
    train_scenarios: Callable[[random.Random], Any]  # one new scenario per call
    val_scenarios: Sequence[Any]
    metrics: Sequence[str]  # trajectory metrics shown in the table (means)
    max_model_len: int = 1024
    # sampling temperature of training rollouts (held-out evaluation is greedy)
    train_temperature: float = 1.0
    # the task's GRPO settings (TrainConfig's defaults otherwise); the learning rate is --learning-rate
    train_config: TrainConfig = field(default_factory=TrainConfig)


async def chat_turn(
    model: TrainableModel, messages: list, user_message: str, *, max_tokens: int, temperature: float
) -> Choice:
    """One turn of a multi-turn rollout: append the user's message, sample the reply from the model's
    latest step, append the choice (what GRPO trains on) and return it."""
    messages.append({"role": "user", "content": user_message})
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=art_ray.get_messages(messages),
        max_tokens=max_tokens,
        temperature=temperature,
    )
    choice = completion.choices[0]
    messages.append(choice)
    return choice


async def tool_turn(
    model: TrainableModel,
    messages: list,
    tools: list[dict],
    *,
    tool_choice: str | dict,
    max_tokens: int,
    temperature: float,
) -> Choice | None:
    """One turn of a tool-calling rollout: sample one call, append the choice (what GRPO trains on) and
    return it; None when the conversation outgrew max_model_len (the episode ends there)."""
    try:
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=art_ray.get_messages(messages),
            tools=tools,
            tool_choice=tool_choice,
            # one call a turn: a small model asked for calls may keep writing them until max_tokens, and a
            # cut-off second call makes vLLM's parser return the whole reply as text
            parallel_tool_calls=False,
            max_tokens=max_tokens,
            temperature=temperature,
        )
    except openai.BadRequestError:
        return None
    choice = completion.choices[0]
    messages.append(choice)
    return choice


def parse_args(task_name: str, doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="base model: smollm2-135m, tiny, a hub id")
    parser.add_argument("--name", default=task_name.replace("_", "-"))
    parser.add_argument("--project", default="examples")
    parser.add_argument("--steps", type=int, default=4, help="train until this step")
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default="./art_ray_runs")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: under --storage)")
    parser.add_argument(
        "--port", type=int, default=None, help="Serve's port (default: 8000 if free, else a free one)"
    )
    parser.add_argument(
        "--model-config",
        type=json.loads,
        default={},
        help='ModelConfig settings as JSON, e.g. \'{"replica_resources": {"inference_node": 0.01}}\'',
    )
    parser.add_argument(
        "--server",
        default=None,
        help="train through a training server (art-ray serve-training) at this URL instead of a Ray cluster",
    )
    parser.add_argument("--api-key", default=os.environ.get("ART_RAY_API_KEY"), help="the server's key")
    return parser.parse_args(argv)


def make_backend(args: argparse.Namespace) -> RayBackend | HTTPBackend:
    """Ray (embedded, or the job's cluster) by default; a remote training server with --server."""
    if args.server:
        return HTTPBackend(args.server, api_key=args.api_key)
    return RayBackend(storage=args.storage, port=args.port, tracking_uri=args.tracking_uri)


def means(group: art_ray.TrajectoryGroup, keys: Sequence[str]) -> dict[str, float]:
    trajectories = list(group)
    summary = {"reward": statistics.fmean(t.reward for t in trajectories) if trajectories else 0.0}
    for key in keys:
        values = [t.metrics[key] for t in trajectories if key in t.metrics]
        summary[key] = statistics.fmean(values) if values else 0.0
    return summary


async def evaluate(task: AgentTask, model: TrainableModel) -> art_ray.TrajectoryGroup:
    """Greedy rollouts on the held-out scenarios, as one group."""
    return art_ray.TrajectoryGroup(
        await asyncio.gather(*(task.rollout(model, scenario, 0.0) for scenario in task.val_scenarios))
    )


async def gather_and_train(
    task: AgentTask,
    model: TrainableModel,
    rng: random.Random,
    groups_per_step: int,
    group_size: int,
    config: TrainConfig,
) -> list[art_ray.TrajectoryGroup]:
    """One GRPO step: `groups_per_step` new scenarios, `group_size` rollouts each (as Ray work), one train
    call; returns the groups it trained on."""
    scenarios = [task.train_scenarios(rng) for _ in range(groups_per_step)]
    groups = await art_ray.gather_trajectory_groups(
        (
            art_ray.TrajectoryGroup(
                task.rollout(model, scenario, task.train_temperature) for _ in range(group_size)
            )
            for scenario in scenarios
        ),
        pbar_desc=None,
        max_exceptions=0.1,
    )
    await model.train(groups, config, verbose=False)
    return groups


def task_model_config(task: AgentTask, lora_rank: int, **settings: Any) -> ModelConfig:
    """The task's model settings (`settings` override them): conversations up to `max_model_len`, one
    packed row per forward (on CPU a bigger micro-batch buys no speed and its activations grow with it:
    1280-token rows of SmolLM2 trained at 140 tokens/s one row at a time, 92 four at a time, in 20 GB)."""
    return ModelConfig(
        **{
            "lora": LoRASpec(r=lora_rank, alpha=2 * lora_rank),
            "sequence_length": task.max_model_len,
            "max_model_len": task.max_model_len,
            "micro_batch_rows": 1,
            **settings,
        }
    )


def row(step: int | str, summary: dict[str, float], keys: Sequence[str], seconds: float | None) -> str:
    cells = [f"{step!s:>6}", f"{summary['reward']:>7.3f}", *(f"{summary[k]:>9.3f}" for k in keys)]
    return "  ".join([*cells, f"{seconds:>7.1f}" if seconds is not None else f"{'':>7}"])


async def train_and_evaluate(task: AgentTask, args: argparse.Namespace) -> dict:
    start = time.time()
    backend = make_backend(args)
    model = TrainableModel(
        name=args.name,
        project=args.project,
        base_model=args.model,
        config=task_model_config(task, args.lora_rank, **args.model_config),
    )
    try:
        await model.register(backend)
        first_step = await model.get_step()
        baseline = await evaluate(task, model)
        await model.log([baseline], split="val")
        keys = list(task.metrics)
        columns = [f"{'step':>6}", f"{'reward':>7}", *(f"{k[:9]:>9}" for k in keys), f"{'seconds':>7}"]
        header = "  ".join(columns)
        print(f"\nheld-out (greedy, {len(task.val_scenarios)} scenarios) and training samples per step")
        print(header)
        print(row("val", means(baseline, keys), keys, None) + f"  (step {first_step}, before)", flush=True)
        rng = random.Random(args.seed + first_step)
        held_out = baseline
        for step in range(first_step, args.steps):
            step_start = time.time()
            groups = await gather_and_train(
                task,
                model,
                rng,
                groups_per_step=args.groups_per_step,
                group_size=args.group_size,
                config=task.train_config.model_copy(update={"learning_rate": args.learning_rate}),
            )
            samples = means(art_ray.TrajectoryGroup([t for g in groups for t in g]), keys)
            held_out = await evaluate(task, model)
            await model.log([held_out], split="val")
            print(row(step + 1, samples, keys, time.time() - step_start) + "  (samples)")
            print(row(step + 1, means(held_out, keys), keys, None) + "  (held-out)", flush=True)
        before, after = means(baseline, keys), means(held_out, keys)
        print("\nbefore -> after (held-out, greedy)")
        for key in ["reward", *keys]:
            print(f"  {key:>12}: {before[key]:.3f} -> {after[key]:.3f}")
        print(f"MLflow: {backend.tracking_uri} (experiment {model.project}, run {model.name})")
        print(f"checkpoints: {backend.model_dir(model)}/checkpoints", flush=True)
        return {
            "task": task.name,
            "baseline": round(before["reward"], 4),
            "final": round(after["reward"], 4),
            **{f"baseline_{k}": round(before[k], 4) for k in keys},
            **{f"final_{k}": round(after[k], 4) for k in keys},
            "steps": await model.get_step(),
            "seconds": round(time.time() - start, 1),
        }
    finally:
        backend.shutdown()


def main(task: AgentTask, doc: str, argv: list[str] | None = None) -> None:
    result = asyncio.run(train_and_evaluate(task, parse_args(task.name, doc, argv)))
    print(json.dumps(result), flush=True)
