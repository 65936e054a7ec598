"""Arithmetic word problems with integer answers, generated from a seed, and the reward for code that
prints the answer."""

from __future__ import annotations

import random
import re

import pydantic

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]
CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


SYSTEM = (
    "Solve the problem by writing a short Python program that prints the answer as a number. "
    "Reply with only the code in a ```python block."
)
# one solved example (a one-shot prompt): a 135M model copies the format instead of writing prose
EXAMPLE = [
    {"role": "user", "content": "Sam has 3 pens and gets 2 more. How many pens does Sam have now?"},
    {"role": "assistant", "content": "```python\npens = 3 + 2\nprint(pens)\n```"},
]
MAX_TOKENS = 64
# held-out problems come from these seeds; training problems from the run's own seed stream
HELD_OUT_SEED = 10_000


class Problem(pydantic.BaseModel):
    question: str
    answer: int


def make_problem(rng: random.Random, level: int = 1) -> Problem:
    """level 1: one operation (+, -, x); level 2: two operations."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        question, answer = f"{name} has {a} {item} and gets {b} more.", a + b
    elif kind == "sub":
        a = a + b
        question, answer = f"{name} has {a} {item} and gives away {b}.", a - b
    else:
        a = rng.randint(2, 9)
        question, answer = f"{name} buys {a} boxes with {b} {item} in each box.", a * b
    if level >= 2:
        c = rng.randint(2, 10)
        question += f" Then {name} loses {c}."
        answer -= c
    return Problem(question=f"{question} How many {item} does {name} have now?", answer=answer)


def messages_for(problem: Problem) -> list[dict[str, str]]:
    """The prompt: the instructions, the solved example, the question."""
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": problem.question}]


def held_out_problems(count: int, level: int = 1) -> list[Problem]:
    """The same `count` held-out problems for every run; the first 12 are the example's default set."""
    return [make_problem(random.Random(HELD_OUT_SEED + i), level) for i in range(count)]


def extract_code(reply: str) -> str:
    """The first fenced code block, or the whole reply when there is none."""
    match = CODE_BLOCK.search(reply)
    return match.group(1) if match else reply


def printed_number(stdout: str) -> float | None:
    """The last number on the last non-empty line the program printed."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    numbers = NUMBER.findall(lines[-1]) if lines else []
    return float(numbers[-1]) if numbers else None


def score(stdout: str, exit_code: int | None, answer: int) -> tuple[float, dict[str, float]]:
    """1 for the right number printed; 0.1 for code that runs and prints a number; else 0."""
    value = printed_number(stdout) if exit_code == 0 else None
    correct = value is not None and abs(value - answer) < 1e-6
    ran = exit_code == 0
    reward = 1.0 if correct else 0.1 if value is not None else 0.0
    return reward, {"correct": float(correct), "ran": float(ran), "printed_number": float(value is not None)}
