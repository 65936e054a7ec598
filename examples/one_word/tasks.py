"""The one-word task: prompts, the reward, and what counts as an exact answer.

The reward is computed on the reply as the user sees it. Hacks seen while designing it: an empty reply
must score 0, and a reply that never stops (finish_reason "length", e.g. a word followed by special
tokens the client strips) is not an exact answer, whatever its visible text. Longer replies get partial
credit (0.5 / words), truncated or not: a reward that is 0 for nearly every sample of a group gives
GRPO nothing to compare.
"""

from __future__ import annotations

import re

INSTRUCTION = "Reply with exactly one word."
WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[.!]?")

TRAIN_QUESTIONS = [
    "What color is the sky on a clear day?",
    "What animal says meow?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What do bees make?",
    "What is frozen water called?",
    "What fruit is yellow and curved?",
    "What do you call a baby dog?",
    "Which season comes after winter?",
    "What is the capital of France?",
    "What gas do plants absorb?",
    "What do cows drink?",
    "What is the largest ocean?",
    "What shape has three sides?",
    "Which metal is liquid at room temperature?",
    "What is the color of grass?",
]
HELD_OUT_QUESTIONS = [
    "What animal barks?",
    "What is the opposite of up?",
    "What do you use to write on paper?",
    "Which star is closest to Earth?",
    "What is the capital of Italy?",
    "What do fish live in?",
    "What color is a ripe banana?",
    "What do you call a young cat?",
    "What is the opposite of night?",
    "Which organ pumps blood?",
    "What falls from clouds?",
    "What is the first month of the year?",
]


def messages_for(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def is_exact(text: str, finish_reason: str | None) -> bool:
    words = text.split()
    return finish_reason == "stop" and len(words) == 1 and WORD.fullmatch(words[0]) is not None


def one_word_reward(text: str, finish_reason: str | None) -> float:
    """1 for one real word that ends the reply, else 0.5 / number of words (0 for nothing)."""
    if is_exact(text, finish_reason):
        return 1.0
    words = text.split()
    return 0.5 / len(words) if words else 0.0
