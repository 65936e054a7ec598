"""2048 on a small board: moves, merges, seeded tile spawns, the end of a game, and the reward.

The board is `size` x `size` (3 by default, so games are short on CPU); a game is won when a tile
reaches `target`. Moves: left, right, up, down; a move that changes nothing is invalid.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

DIRECTIONS = ("left", "right", "up", "down")
MOVE = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)


def merge_line(line: list[int]) -> tuple[list[int], int]:
    """Slide a row to the left and merge equal neighbours once each; returns (row, points)."""
    tiles = [value for value in line if value]
    merged, points, index = [], 0, 0
    while index < len(tiles):
        if index + 1 < len(tiles) and tiles[index] == tiles[index + 1]:
            merged.append(tiles[index] * 2)
            points += tiles[index] * 2
            index += 2
        else:
            merged.append(tiles[index])
            index += 1
    return merged + [0] * (len(line) - len(merged)), points


@dataclass
class Game:
    size: int = 3
    target: int = 64
    seed: int = 0
    cells: list[list[int]] = field(default_factory=list)
    score: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if not self.cells:
            self.cells = [[0] * self.size for _ in range(self.size)]
            self.spawn()
            self.spawn()

    def spawn(self) -> None:
        empty = [(r, c) for r in range(self.size) for c in range(self.size) if not self.cells[r][c]]
        if empty:
            row, column = self._rng.choice(empty)
            self.cells[row][column] = 4 if self._rng.random() < 0.1 else 2

    def _rows(self, direction: str) -> list[list[int]]:
        grid = self.cells
        if direction in ("up", "down"):
            grid = [list(column) for column in zip(*grid, strict=True)]
        if direction in ("right", "down"):
            grid = [row[::-1] for row in grid]
        return grid

    def _set_rows(self, direction: str, rows: list[list[int]]) -> None:
        if direction in ("right", "down"):
            rows = [row[::-1] for row in rows]
        if direction in ("up", "down"):
            rows = [list(column) for column in zip(*rows, strict=True)]
        self.cells = rows

    def move(self, direction: str) -> bool:
        """Apply a move and spawn a tile; False (and no change) if the move changes nothing."""
        results = [merge_line(row) for row in self._rows(direction)]
        rows = [row for row, _ in results]
        if rows == self._rows(direction):
            return False
        self._set_rows(direction, rows)
        self.score += sum(points for _, points in results)
        self.spawn()
        return True

    def max_tile(self) -> int:
        return max(max(row) for row in self.cells)

    def won(self) -> bool:
        return self.max_tile() >= self.target

    def can_move(self) -> bool:
        return any(merge_line(row)[0] != row for d in DIRECTIONS for row in self._rows(d))

    def finished(self) -> bool:
        return self.won() or not self.can_move()

    def render(self) -> str:
        width = len(str(self.max_tile()))
        return "\n".join(" ".join(str(v or ".").rjust(width) for v in row) for row in self.cells)


def parse_move(reply: str) -> str | None:
    match = MOVE.search(reply)
    return match.group(1).lower() if match else None


def reward(game: Game, invalid_moves: int) -> float:
    """1 for reaching the target; else log2(max tile) / log2(target); minus 0.1 per invalid move."""
    progress = 1.0 if game.won() else math.log2(game.max_tile()) / math.log2(game.target)
    return progress - 0.1 * invalid_moves
