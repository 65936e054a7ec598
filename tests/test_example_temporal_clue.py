"""examples/temporal_clue: every generated puzzle has exactly one solution, the answer is right, and the
reward checks the reply (pure logic)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "temporal_clue"))

from puzzles import answer_reward, clue_holds, make_puzzle, solutions  # noqa: E402


@pytest.mark.parametrize("suspects", [3, 4, 5])
def test_every_puzzle_has_one_solution_and_the_answer_is_in_it(suspects: int) -> None:
    for seed in range(40):
        puzzle = make_puzzle(random.Random(seed), suspects)
        (only,) = solutions(puzzle.suspects, puzzle.times, puzzle.clues)
        assert only[puzzle.times.index(puzzle.question_time)] == puzzle.answer
        assert all(clue_holds(clue, only, puzzle.times) for clue in puzzle.clues)


def test_puzzles_are_seeded() -> None:
    assert make_puzzle(random.Random(9)) == make_puzzle(random.Random(9))
    assert make_puzzle(random.Random(9)) != make_puzzle(random.Random(10))


def test_clue_forms() -> None:
    times = ["8 pm", "9 pm", "10 pm"]
    order = ("Ben", "Ana", "Eli")
    assert clue_holds("Ana arrived at 9 pm.", order, times)
    assert clue_holds("Ben arrived before Eli.", order, times)
    assert not clue_holds("Eli arrived before Ana.", order, times)
    assert clue_holds("Eli was not the first to arrive.", order, times)
    assert not clue_holds("Eli was not the last to arrive.", order, times)
    assert clue_holds("Ben did not arrive at 10 pm.", order, times)
    with pytest.raises(ValueError, match="unknown clue form"):
        clue_holds("Ana likes tea.", order, times)


def test_reward_needs_the_answer_and_only_it() -> None:
    puzzle = make_puzzle(random.Random(1))
    others = [s for s in puzzle.suspects if s != puzzle.answer]
    assert answer_reward(f"{puzzle.answer}.", puzzle) == (1.0, True)
    assert answer_reward(f"{puzzle.answer} or {others[0]}", puzzle) == (0.0, False)
    assert answer_reward(others[0], puzzle) == (0.2, False)
    assert answer_reward("I cannot tell.", puzzle) == (0.0, False)
