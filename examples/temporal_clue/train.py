"""Temporal Clue with GRPO on art-ray: generated deduction puzzles (who arrived when) with one verifiable
answer; the easiest setting has 3 suspects (raise SUSPECTS below, up to 6, for harder puzzles).

    python examples/temporal_clue/train.py --steps 4

Reward: 1 if the reply names the right suspect and no other, 0.2 if it names exactly one other suspect,
else 0. Metrics: correct, words (reply length).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from loop import AgentTask, main  # noqa: E402
from puzzles import Puzzle, answer_reward, make_puzzle  # noqa: E402

import art_ray  # noqa: E402
from art_ray import TrainableModel, Trajectory  # noqa: E402

SYSTEM = "Solve the puzzle. Reply with only the name of the person."
SUSPECTS, MAX_TOKENS = 3, 12


@art_ray.remote_rollout
async def rollout(model: TrainableModel, puzzle: Puzzle, temperature: float) -> Trajectory:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": puzzle.text()}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=MAX_TOKENS, temperature=temperature
    )
    choice = completion.choices[0]
    reply = choice.message.content or ""
    reward, correct = answer_reward(reply, puzzle)
    return Trajectory(
        messages_and_choices=[*messages, choice],
        reward=reward,
        metrics={"correct": float(correct), "words": float(len(reply.split()))},
    )


TASK = AgentTask(
    name="temporal_clue",
    rollout=rollout,
    train_scenarios=lambda rng: make_puzzle(rng, SUSPECTS),
    val_scenarios=[make_puzzle(random.Random(30_000 + i), SUSPECTS) for i in range(16)],
    metrics=["correct", "words"],
)

if __name__ == "__main__":
    main(TASK, __doc__)
