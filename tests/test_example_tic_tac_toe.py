"""examples/tic_tac_toe: rules, terminal states, the opponent and the reward (pure logic)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "tic_tac_toe"))

from tictactoe import Board, opponent_move, outcome_reward, parse_move  # noqa: E402


def board(text: str) -> Board:
    return Board(cells=[" " if c == "." else c for c in text])


def test_lines_win_and_a_full_board_without_a_line_is_a_draw() -> None:
    assert board("XXX......").winner() == "X"
    assert board("O...O...O").winner() == "O"
    assert board("..X.X.X..").winner() == "X"
    draw = board("XOXXOOOXX")
    assert draw.winner() is None and draw.finished()
    assert not board("XO.......").finished()


def test_moves_must_be_free_cells_and_parse_from_the_reply() -> None:
    game = Board()
    game.play(4, "X")
    with pytest.raises(ValueError, match="cell 5 is not empty"):
        game.play(4, "O")
    assert parse_move("I take 7.") == 6
    assert parse_move(" 3") == 2
    assert parse_move("the center") is None
    assert parse_move("0") is None


def test_render_numbers_the_free_cells() -> None:
    assert board("X...O....").render().splitlines()[0] == " X | 2 | 3"


def test_the_opponent_wins_then_blocks_then_plays_randomly() -> None:
    assert opponent_move(board("OO.XX...."), random.Random(0)) == 2  # its own win first
    assert opponent_move(board("XX..O...."), random.Random(0)) == 2  # else block X
    open_board = board("X........")
    moves = {opponent_move(open_board, random.Random(seed)) for seed in range(30)}
    assert moves <= set(open_board.empty()) and len(moves) > 3
    assert opponent_move(open_board, random.Random(5)) == opponent_move(open_board, random.Random(5))


def test_reward_orders_win_draw_loss_and_illegal_play() -> None:
    assert outcome_reward(board("XXXOO...."), 3, illegal=False) == 1.0
    assert outcome_reward(board("XOXXOOOXX"), 5, illegal=False) == 0.5
    assert outcome_reward(board("OOOXX.X.."), 3, illegal=False) == 0.0
    assert outcome_reward(Board(), 0, illegal=True) == -1.0
    assert outcome_reward(Board(), 2, illegal=True) == pytest.approx(-0.8)
