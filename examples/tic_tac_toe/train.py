"""Tic-tac-toe with GRPO on art-ray: the model (X) plays a scripted opponent; each move is one chat
completion in one growing conversation.

    python examples/tic_tac_toe/train.py --steps 4

Reward: win 1, draw 0.5, loss 0; an illegal or unreadable move ends the game (-1, +0.1 per legal move
made before it). Metrics: legal (share of games without an illegal move), win, draw, moves.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from loop import AgentTask, chat_turn, main  # noqa: E402
from tictactoe import Board, opponent_move, outcome_reward, parse_move  # noqa: E402

import art_ray  # noqa: E402
from art_ray import TrainableModel, Trajectory  # noqa: E402

SYSTEM = (
    "You play tic-tac-toe as X against O. The cells are numbered 1 to 9; a free cell shows its number. "
    "Reply with the number of the free cell you take, and nothing else."
)
MAX_TOKENS = 6


@art_ray.remote_rollout
async def rollout(model: TrainableModel, game_seed: int, temperature: float) -> Trajectory:
    rng = random.Random(game_seed)
    board = Board()
    messages: list = [{"role": "system", "content": SYSTEM}]
    legal_moves, illegal = 0, False
    while not board.finished():
        free = ", ".join(str(cell + 1) for cell in board.empty())
        prompt = f"{board.render()}\n\nFree cells: {free}. Your move, one number from that list:"
        choice = await chat_turn(model, messages, prompt, max_tokens=MAX_TOKENS, temperature=temperature)
        cell = parse_move(choice.message.content or "")
        if cell is None or cell not in board.empty():
            illegal = True
            break
        board.play(cell, "X")
        legal_moves += 1
        if board.finished():
            break
        board.play(opponent_move(board, rng), "O")
    winner = board.winner()
    return Trajectory(
        messages_and_choices=messages,
        reward=outcome_reward(board, legal_moves, illegal),
        metrics={
            "legal": float(not illegal),
            "win": float(winner == "X" and not illegal),
            "draw": float(winner is None and not illegal),
            "moves": float(legal_moves),
        },
    )


TASK = AgentTask(
    name="tic_tac_toe",
    rollout=rollout,
    train_scenarios=lambda rng: rng.randrange(1_000_000),  # a game = the opponent's seed
    val_scenarios=list(range(10_000, 10_012)),
    metrics=["legal", "win", "draw", "moves"],
    train_temperature=0.7,
)

if __name__ == "__main__":
    main(TASK, __doc__)
