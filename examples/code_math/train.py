"""Code math with GRPO on art-ray: the model answers a word problem by writing Python that prints the
answer; the code runs in art-ray's sandbox pool (examples/code_math/execute.py: isolated warm slots
leased one program at a time), never in the driver, a rollout runner or the trainer, and the reward
checks what it printed.

    python examples/code_math/train.py --steps 4

Reward: 1 if the printed number equals the answer, 0.1 if the code ran and printed some number, else 0.
Metrics: correct, ran (exit code 0), printed_number.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from execute import run_program  # noqa: E402
from loop import AgentTask, main  # noqa: E402
from problems import (  # noqa: E402
    MAX_TOKENS,
    Problem,
    extract_code,
    held_out_problems,
    make_problem,
    messages_for,
    score,
)

import art_ray  # noqa: E402
from art_ray import TrainableModel, TrainConfig, Trajectory  # noqa: E402


@art_ray.remote_rollout
async def rollout(model: TrainableModel, problem: Problem, temperature: float) -> Trajectory:
    messages = messages_for(problem)
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=MAX_TOKENS, temperature=temperature
    )
    choice = completion.choices[0]
    result = await run_program(extract_code(choice.message.content or ""))  # SandboxError: dropped
    reward, metrics = score(result.stdout, result.exit_code, problem.answer)
    return Trajectory(
        messages_and_choices=[*messages, choice],
        reward=reward,
        metrics=metrics,
        logs=[f"stdout: {result.stdout[-200:]!r}", f"stderr: {result.stderr[-200:]!r}"],
    )


TASK = AgentTask(
    name="code_math",
    rollout=rollout,
    train_scenarios=lambda rng: make_problem(rng, level=1),
    val_scenarios=held_out_problems(12),
    metrics=["correct", "ran", "printed_number"],
    # Dr. GRPO: divided by the group's std, the 0.1 for code that prints any number weighed as much as a
    # right answer, and SmolLM2 collapsed onto the prompt's example program (held-out 0.32 -> 0.06 in 7
    # steps); only centred, it went 0.32 -> 1.00 in 22 steps (bench/learning.py, seed 0)
    train_config=TrainConfig(scale_rewards=False),
)

if __name__ == "__main__":
    main(TASK, __doc__)
