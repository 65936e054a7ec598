"""2048 with GRPO on art-ray: each move is one chat completion in one conversation; the easiest setting
is a 3x3 board, target tile 64, at most 12 moves (`--steps`, `--group-size` as in every example).

    python examples/game_2048/train.py --steps 4

Reward: 1 for reaching the target tile, else log2(max tile) / log2(target), minus 0.1 per invalid move
(unreadable, or a direction that moves nothing); three invalid moves end the game.
Metrics: max_tile, valid (share of moves that were valid), moves, won.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from board2048 import Game, parse_move, reward  # noqa: E402
from loop import AgentTask, chat_turn, main  # noqa: E402

import art_ray  # noqa: E402
from art_ray import TrainableModel, Trajectory  # noqa: E402

SYSTEM = (
    "You play 2048 on a 3x3 board. Equal tiles that slide into each other merge. Reach the 64 tile. "
    "Reply with one word: left, right, up or down."
)
MAX_MOVES, MAX_INVALID, MAX_TOKENS = 12, 3, 4


@art_ray.remote_rollout
async def rollout(model: TrainableModel, game_seed: int, temperature: float) -> Trajectory:
    game = Game(size=3, target=64, seed=game_seed)
    messages: list = [{"role": "system", "content": SYSTEM}]
    valid = invalid = 0
    while not game.finished() and valid + invalid < MAX_MOVES and invalid < MAX_INVALID:
        prompt = f"{game.render()}\n\nYour move:"
        choice = await chat_turn(model, messages, prompt, max_tokens=MAX_TOKENS, temperature=temperature)
        direction = parse_move(choice.message.content or "")
        if direction is not None and game.move(direction):
            valid += 1
        else:
            invalid += 1
    return Trajectory(
        messages_and_choices=messages,
        reward=reward(game, invalid),
        metrics={
            "max_tile": float(game.max_tile()),
            "valid": valid / max(1, valid + invalid),
            "moves": float(valid + invalid),
            "won": float(game.won()),
        },
    )


TASK = AgentTask(
    name="game_2048",
    rollout=rollout,
    train_scenarios=lambda rng: rng.randrange(1_000_000),  # a game = its tile-spawn seed
    val_scenarios=list(range(20_000, 20_012)),
    metrics=["max_tile", "valid", "moves", "won"],
    train_temperature=0.7,
)

if __name__ == "__main__":
    main(TASK, __doc__)
