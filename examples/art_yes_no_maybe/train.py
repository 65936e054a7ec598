"""ART's yes-no-maybe example, written for OpenPipe ART 0.5 as ART's docs write it for LocalBackend; the
one art-ray line is the backend. Needs `pip install "art-ray[art]"` (make setup installs it).

    .venv/bin/python examples/art_yes_no_maybe/train.py --steps 4

Prints each step's reward and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

import art

import art_ray

PROMPTS = [
    f"{prefix} with {', '.join(words)}. Reply with one word."
    for prefix in ("Respond", "Just respond", "Answer")
    for words in itertools.permutations(("yes", "no", "maybe"))
]


def reward_for(content: str | None) -> float:
    word = (content or "").strip().strip(".!?\"'").lower()
    return {"maybe": 1.0, "no": 0.75, "yes": 0.5}.get(word, 0.0)


async def rollout(model: art.TrainableModel, prompt: str) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=5
    )
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward_for(choice.message.content))


async def main(backend: art.Backend, args: argparse.Namespace) -> dict:
    model = art.TrainableModel(name=args.name, project="yes-no-maybe", base_model=args.model)
    await model.register(backend)
    rewards = []
    for _ in range(await model.get_step(), args.steps):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, prompt) for _ in range(args.group_size))
                for prompt in PROMPTS[:4]
            ),
            pbar_desc="gather",
        )
        result = await backend.train(model, groups, learning_rate=args.learning_rate)
        await model.log(groups, split="train", step=result.step, metrics=result.metrics)
        rewards.append(sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups))
        print(f"step {result.step}: reward {rewards[-1]:.3f}", flush=True)
    await model.delete_checkpoints()
    return {"example": "art_yes_no_maybe", "steps": await model.get_step(), "rewards": rewards}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="agent-001")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--storage", default="art_ray_runs/art_yes_no_maybe")
    arguments = parser.parse_args()
    start = time.time()
    backend = art_ray.ARTBackend(storage=arguments.storage)  # was: backend = LocalBackend()
    try:
        summary = asyncio.run(main(backend, arguments))
    finally:
        asyncio.run(backend.close())
    print(json.dumps({**summary, "seconds": round(time.time() - start, 1)}))
