"""Temporal deduction puzzles with one verifiable answer: who arrived at which time.

A puzzle has `n` suspects, each arriving at a different one of `n` times. Clues are true statements
about the hidden order (fixed times, before/after, not-at, not-first/not-last); the generator adds clues
until exactly one order satisfies all of them (checked by brute force over the n! orders), then asks who
arrived at one of the times.
"""

from __future__ import annotations

import itertools
import random
import re

import pydantic

SUSPECTS = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay"]
TIMES = ["8 pm", "9 pm", "10 pm", "11 pm", "midnight", "1 am"]

Order = tuple[str, ...]  # order[i] = the suspect who arrived at TIMES[i]


class Puzzle(pydantic.BaseModel):
    suspects: list[str]
    times: list[str]
    clues: list[str]
    question_time: str
    answer: str

    def text(self) -> str:
        clues = "\n".join(f"- {clue}" for clue in self.clues)
        return (
            f"{', '.join(self.suspects)} each arrived at a different time: {', '.join(self.times)}.\n"
            f"{clues}\nWho arrived at {self.question_time}?"
        )


def true_clues(order: Order, times: list[str], rng: random.Random) -> list[str]:
    """Statements that hold for `order`, in every clue form."""
    n = len(order)
    clues = []
    for i, suspect in enumerate(order):
        clues.append(f"{suspect} arrived at {times[i]}.")
        clues.append(f"{suspect} did not arrive at {times[rng.choice([j for j in range(n) if j != i])]}.")
        if i != 0:
            clues.append(f"{suspect} was not the first to arrive.")
        if i != n - 1:
            clues.append(f"{suspect} was not the last to arrive.")
    clues += [f"{a} arrived before {b}." for a, b in itertools.combinations(order, 2)]
    return clues


def clue_holds(clue: str, order: Order, times: list[str]) -> bool:
    if match := re.fullmatch(r"(\w+) arrived at (.+)\.", clue):
        return order[times.index(match.group(2))] == match.group(1)
    if match := re.fullmatch(r"(\w+) did not arrive at (.+)\.", clue):
        return order[times.index(match.group(2))] != match.group(1)
    if match := re.fullmatch(r"(\w+) was not the first to arrive\.", clue):
        return order[0] != match.group(1)
    if match := re.fullmatch(r"(\w+) was not the last to arrive\.", clue):
        return order[-1] != match.group(1)
    if match := re.fullmatch(r"(\w+) arrived before (\w+)\.", clue):
        return order.index(match.group(1)) < order.index(match.group(2))
    raise ValueError(f"unknown clue form: {clue!r}")


def solutions(suspects: list[str], times: list[str], clues: list[str]) -> list[Order]:
    """Every order consistent with the clues, by brute force."""
    return [
        order
        for order in itertools.permutations(suspects)
        if all(clue_holds(clue, order, times) for clue in clues)
    ]


def make_puzzle(rng: random.Random, n: int = 3) -> Puzzle:
    suspects, times = sorted(rng.sample(SUSPECTS, n)), TIMES[:n]
    order: Order = tuple(rng.sample(suspects, n))
    candidates = true_clues(order, times, rng)
    rng.shuffle(candidates)
    # relational clues first, so the puzzle needs a deduction rather than a lookup
    candidates.sort(key=lambda clue: " arrived at " in clue)
    possible = list(itertools.permutations(suspects))
    clues: list[str] = []
    for clue in candidates:
        remaining = [o for o in possible if clue_holds(clue, o, times)]
        if len(remaining) < len(possible):  # only clues that rule something out
            clues.append(clue)
            possible = remaining
        if len(possible) == 1:
            break
    rng.shuffle(clues)
    asked = rng.randrange(n)
    question_time, answer = times[asked], order[asked]
    return Puzzle(suspects=suspects, times=times, clues=clues, question_time=question_time, answer=answer)


def answer_reward(reply: str, puzzle: Puzzle) -> tuple[float, bool]:
    """(reward, correct): 1 for naming the answer and no other suspect; 0.2 for naming exactly one other
    suspect (a committed answer, so GRPO can compare answers before any is right); else 0."""
    named = {s for s in puzzle.suspects if re.search(rf"\b{s}\b", reply)}
    if named == {puzzle.answer}:
        return 1.0, True
    return (0.2 if len(named) == 1 else 0.0), False
