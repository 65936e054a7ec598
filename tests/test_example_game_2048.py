"""examples/game_2048: merges, moves, seeded spawns, the end of a game and the reward (pure logic)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "game_2048"))

from board2048 import Game, merge_line, parse_move, reward  # noqa: E402


def test_merges_happen_once_per_tile_toward_the_move() -> None:
    assert merge_line([2, 2, 2, 2]) == ([4, 4, 0, 0], 8)
    assert merge_line([2, 2, 4, 0]) == ([4, 4, 0, 0], 4)  # the new 4 does not merge again
    assert merge_line([0, 2, 0, 2]) == ([4, 0, 0, 0], 4)
    assert merge_line([4, 2, 2]) == ([4, 4, 0], 4)
    assert merge_line([2, 4, 8]) == ([2, 4, 8], 0)


def test_moves_in_every_direction_and_an_invalid_move_changes_nothing() -> None:
    game = Game(cells=[[2, 0, 2], [0, 0, 0], [0, 0, 4]], seed=1)
    assert game.move("left") and game.cells[0][0] == 4 and game.score == 4
    blocked = Game(cells=[[2, 4, 8], [4, 8, 2], [8, 2, 4]])
    assert not blocked.move("left") and blocked.cells == [[2, 4, 8], [4, 8, 2], [8, 2, 4]]
    assert blocked.finished() and not blocked.won()
    column = Game(cells=[[2, 0, 0], [2, 0, 0], [0, 0, 0]], seed=3)
    assert column.move("down") and column.cells[2][0] == 4
    right = Game(cells=[[2, 2, 0], [0, 0, 0], [0, 0, 0]], seed=3)
    assert right.move("right") and right.cells[0][2] == 4


def test_spawns_are_seeded_and_the_game_is_won_at_the_target() -> None:
    assert Game(seed=7).cells == Game(seed=7).cells
    assert sum(v > 0 for row in Game(seed=7).cells for v in row) == 2
    assert Game(cells=[[64, 0, 0], [0, 0, 0], [0, 0, 0]], target=64).won()


def test_reward_and_move_parsing() -> None:
    won = Game(cells=[[64, 2, 0], [0, 0, 0], [0, 0, 0]], target=64)
    assert reward(won, 0) == 1.0
    halfway = Game(cells=[[8, 2, 0], [0, 0, 0], [0, 0, 0]], target=64)
    assert reward(halfway, 2) == math.log2(8) / math.log2(64) - 0.2
    assert parse_move("I go Left.") == "left" and parse_move("upward") is None
