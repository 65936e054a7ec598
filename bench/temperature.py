"""How far the trainer's logprobs are from the engine's at a step's start, by sampling temperature.

SmolLM2-135M through the user's path (RayBackend, TrainableModel, the OpenAI client): for each temperature,
--prompts groups of --group-size samples, then two train calls at a learning rate too small to move the
adapter (so both start from the policy that sampled): the choices as served (each token's logprobs computed
at its own temperature), and the same choices without their `sampling_params`, which train at temperature 1
(what a trajectory of an older version, or built by hand, gets). The figure is the first gradient step's
`loss/old_logprob_diff`: the mean |trainer logprob - engine logprob| over the trained tokens (0: ratio 1).
Last line: {"bench": "temperature", "diff_at_own_temperature": {T: ...}, "diff_at_1": {T: ...}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table, start_local_ray  # noqa: E402

PROMPTS = [
    "Name a color.",
    "Say a number.",
    "Pick an animal.",
    "Name a fruit.",
    "Say a city.",
    "Name a tool.",
    "Pick a sport.",
    "Say a planet.",
]


def without_sampling_params(groups: list) -> list:
    """The groups as an older version recorded them: choices without sampling_params (trained at 1)."""
    from openai.types.chat.chat_completion import Choice

    from art_ray import TrajectoryGroup

    stripped = []
    for group in groups:
        trajectories = []
        for trajectory in group:
            items = [
                Choice.model_validate(item.model_dump(exclude={"sampling_params"}))
                if isinstance(item, Choice)
                else item
                for item in trajectory.messages_and_choices
            ]
            trajectories.append(trajectory.model_copy(update={"messages_and_choices": items}))
        stripped.append(TrajectoryGroup(trajectories))
    return stripped


async def sample(model, temperature: float, prompts: int, group_size: int) -> list:  # noqa: ANN001
    from art_ray import Trajectory, TrajectoryGroup, sampled_tokens

    client = model.openai_client()
    groups = []
    for prompt in PROMPTS[:prompts]:
        messages = [{"role": "user", "content": prompt}]
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            n=group_size,
            max_tokens=12,
            temperature=temperature,
        )
        groups.append(
            TrajectoryGroup(
                # any reward with spread inside a group: the figure is about logprobs, not learning
                Trajectory(
                    messages_and_choices=[*messages, choice],
                    reward=float(len(sampled_tokens(choice).token_ids) % 3),
                )
                for choice in response.choices
            )
        )
    return groups


async def measure(args: argparse.Namespace, storage: str) -> list[dict]:
    import warnings

    from art_ray import LoRASpec, ModelConfig, RayBackend, TrainableModel, TrainConfig

    backend = RayBackend(
        storage=storage, port=free_port(), app_name="temperature", route_prefix="/temperature"
    )
    model = TrainableModel(
        name="temperature",
        project="bench",
        base_model="smollm2-135m",
        config=ModelConfig(
            lora=LoRASpec(r=8, alpha=16),
            sequence_length=256,
            max_model_len=512,
            replica_cpus=0,
            trainer_cpus_per_rank=0,
        ),
    )
    still = TrainConfig(learning_rate=1e-9, num_gradient_steps=1)
    rows = []
    try:
        await model.register(backend)
        for temperature in args.temperatures:
            groups = await sample(model, temperature, args.prompts, args.group_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the untempered call's "no sampling_params" warning
                await model.train(without_sampling_params(groups), still, verbose=False)
            at_1 = model.last_train_metrics[0]
            await model.train(groups, still, verbose=False)
            own = model.last_train_metrics[0]
            rows.append(
                {
                    "temperature": temperature,
                    "tokens": own["data/trained_tokens"],
                    "diff_own": own["loss/old_logprob_diff"],
                    "clip_own": own["loss/clip_fraction"],
                    "diff_at_1": at_1["loss/old_logprob_diff"],
                    "clip_at_1": at_1["loss/clip_fraction"],
                }
            )
    finally:
        await asyncio.to_thread(backend.shutdown)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 0.7, 1.0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    start_local_ray()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as storage:
        rows = asyncio.run(measure(args, storage))
    print_table(
        "Trainer vs engine logprobs at a step's start: mean |difference| over the trained tokens "
        "(and the share of tokens PPO clips)",
        ["temperature", "tokens", "own temperature", "clipped", "as if at 1", "clipped at 1", "ratio"],
        [
            [
                row["temperature"],
                int(row["tokens"]),
                f"{row['diff_own']:.2e}",
                row["clip_own"],
                f"{row['diff_at_1']:.2e}",
                row["clip_at_1"],
                f"{row['diff_at_1'] / max(row['diff_own'], 1e-12):.0f}x",
            ]
            for row in rows
        ],
    )
    print_result(
        {
            "bench": "temperature",
            "diff_at_own_temperature": {str(row["temperature"]): row["diff_own"] for row in rows},
            "diff_at_1": {str(row["temperature"]): row["diff_at_1"] for row in rows},
            "clip_at_own_temperature": {str(row["temperature"]): row["clip_own"] for row in rows},
            "max_diff_at_own_temperature": max(row["diff_own"] for row in rows),
            "seconds": round(time.monotonic() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
