"""Small generated repositories with a failing test, and the hidden checks that grade them (pure logic: no
art_ray, no sandbox).

Two kinds, drawn from a seed:
- `fix`: `calc.py` has a function with the wrong operator (`return a - b` where the tests want a + b);
- `write`: `calc.py` has a stub (`raise NotImplementedError`) whose docstring says what to return.

The agent sees the module, the visible test and its failing output. After the episode a hidden check
(more cases than the visible test) runs on what the agent left; it prints a random token last, so a
module that exits early with status 0 does not pass.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

NAMES = [
    "combine",
    "merge_values",
    "total",
    "blend",
    "mix",
    "join_numbers",
    "fold",
    "pair_up",
    "apply",
    "reduce2",
]
OPERATORS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b),
}
MODULE, VISIBLE_TEST = "calc.py", "test_calc.py"
TEST_COMMAND = f"python -m pytest -q -p no:cacheprovider {VISIBLE_TEST}"


@dataclass(frozen=True)
class Repo:
    kind: str  # fix or write
    function: str
    operator: str  # the right one
    files: dict[str, str] = field(hash=False)  # what the agent starts with
    cases: tuple[tuple[int, int], ...]  # the hidden check's arguments

    @property
    def source(self) -> str:
        return self.files[MODULE]

    def expected(self, a: int, b: int) -> int:
        return OPERATORS[self.operator][1](a, b)


def make_repo(rng: random.Random) -> Repo:
    kind = rng.choice(["fix", "write"])
    function = rng.choice(NAMES)
    operator = rng.choice(list(OPERATORS))
    words = OPERATORS[operator][0]
    if kind == "fix":
        wrong = rng.choice([op for op in OPERATORS if op != operator])
        source = f'def {function}(a, b):\n    """Return a {words} b."""\n    return a {wrong} b\n'
    else:
        source = f'def {function}(a, b):\n    """Return a {words} b."""\n    raise NotImplementedError\n'
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    expected = OPERATORS[operator][1](a, b)
    test = (
        f"from calc import {function}\n\n\n"
        f"def test_{function}():\n    assert {function}({a}, {b}) == {expected}\n"
    )
    cases = ((a, b), *((rng.randint(-20, 20), rng.randint(-20, 20)) for _ in range(4)))
    return Repo(kind, function, operator, {MODULE: source, VISIBLE_TEST: test}, cases)


def held_out_repos(count: int, seed: int = 10_000) -> list[Repo]:
    """The same repositories for every run (apart from the training seeds)."""
    rng = random.Random(seed)
    return [make_repo(rng) for _ in range(count)]


def hidden_check(repo: Repo) -> tuple[str, str]:
    """The check's source and the token it prints last when every case holds."""
    token = secrets.token_hex(8)
    lines = [
        "import importlib.util",
        f"spec = importlib.util.spec_from_file_location('calc', '/workspace/{MODULE}')",
        "calc = importlib.util.module_from_spec(spec)",
        "spec.loader.exec_module(calc)",
        *(f"assert calc.{repo.function}({a}, {b}) == {repo.expected(a, b)}" for a, b in repo.cases),
        f"print({token!r})",
    ]
    return "\n".join(lines) + "\n", token


def passed(stdout: str, exit_code: int | None, token: str) -> bool:
    lines = stdout.strip().splitlines()
    return exit_code == 0 and bool(lines) and lines[-1] == token
