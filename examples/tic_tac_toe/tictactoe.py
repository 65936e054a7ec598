"""Tic-tac-toe against a scripted opponent: the board, the rules, the opponent and the reward.

The model plays X and moves first; the opponent (O) takes a winning cell if it has one, else blocks
X's winning cell, else plays a random empty cell (seeded per game). Cells are numbered 1-9, row by row.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
MOVE = re.compile(r"[1-9]")
# win 1, draw 0.5, loss 0; an illegal or unreadable move ends the game at -1 plus 0.1 per legal move
# before it, so a group still ranks the players who lasted longer
ILLEGAL_BASE, LEGAL_MOVE_CREDIT = -1.0, 0.1


@dataclass
class Board:
    cells: list[str] = field(default_factory=lambda: [" "] * 9)

    def empty(self) -> list[int]:
        return [i for i, cell in enumerate(self.cells) if cell == " "]

    def winner(self) -> str | None:
        for a, b, c in LINES:
            if self.cells[a] != " " and self.cells[a] == self.cells[b] == self.cells[c]:
                return self.cells[a]
        return None

    def finished(self) -> bool:
        return self.winner() is not None or not self.empty()

    def play(self, cell: int, mark: str) -> None:
        if cell not in self.empty():
            raise ValueError(f"cell {cell + 1} is not empty")
        self.cells[cell] = mark

    def render(self) -> str:
        shown = [mark if mark != " " else str(i + 1) for i, mark in enumerate(self.cells)]
        rows = [" " + " | ".join(shown[r * 3 : r * 3 + 3]) for r in range(3)]
        return "\n---+---+---\n".join(rows)


def parse_move(reply: str) -> int | None:
    """The first cell number 1-9 in the reply, as a 0-based index; None if there is none."""
    match = MOVE.search(reply)
    return int(match.group()) - 1 if match else None


def _completing_cell(board: Board, mark: str) -> int | None:
    for line in LINES:
        marks = [board.cells[i] for i in line]
        if marks.count(mark) == 2 and marks.count(" ") == 1:
            return line[marks.index(" ")]
    return None


def opponent_move(board: Board, rng: random.Random) -> int:
    for mark in ("O", "X"):  # win if possible, else block
        cell = _completing_cell(board, mark)
        if cell is not None:
            return cell
    return rng.choice(board.empty())


def outcome_reward(board: Board, legal_moves: int, illegal: bool) -> float:
    if illegal:
        return ILLEGAL_BASE + LEGAL_MOVE_CREDIT * legal_moves
    return {"X": 1.0, "O": 0.0, None: 0.5}[board.winner()]
