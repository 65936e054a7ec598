"""examples/code_math: problems, answer extraction, reward, and the sandbox's limits (pure logic plus
child processes; no Ray)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "code_math"))

from problems import extract_code, make_problem, printed_number, score  # noqa: E402
from sandbox import network_namespace_available, run_python  # noqa: E402


def test_problems_are_seeded_and_their_answers_are_right() -> None:
    assert make_problem(random.Random(3)) == make_problem(random.Random(3))
    for seed in range(50):
        problem = make_problem(random.Random(seed), level=2)
        assert problem.question.endswith("now?") and isinstance(problem.answer, int)
    problem = make_problem(random.Random(0))
    numbers = [int(n) for n in problem.question.replace(".", " ").split() if n.isdigit()]
    assert problem.answer in {numbers[0] + numbers[1], numbers[0] - numbers[1], numbers[0] * numbers[1]}


def test_code_extraction_and_the_printed_number() -> None:
    assert extract_code("Here:\n```python\nprint(2 + 3)\n```\nDone") == "print(2 + 3)\n"
    assert extract_code("print(7)") == "print(7)"
    assert printed_number("working\nanswer: 42\n") == 42.0
    assert printed_number("") is None


def test_reward_for_right_wrong_and_broken_code() -> None:
    assert score("12\n", 0, 12)[0] == 1.0
    assert score("13\n", 0, 12) == (0.1, {"correct": 0.0, "ran": 1.0, "printed_number": 1.0})
    assert score("", 1, 12)[0] == 0.0
    assert score("12\n", 1, 12)[0] == 0.0  # a crash after printing is not an answer


def test_the_sandbox_runs_code_and_returns_its_output() -> None:
    result = run_python("a = 6\nb = 7\nprint(a * b)")
    assert (result.stdout, result.exit_code, result.timed_out) == ("42\n", 0, False)


def test_an_endless_loop_times_out() -> None:
    result = run_python("while True:\n    pass", timeout_s=1.0)
    assert result.timed_out and result.exit_code is None


def test_a_memory_bomb_fails_inside_the_limit() -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=128)
    assert result.exit_code != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_no_network() -> None:
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nprint('connected')"
    result = run_python(code)
    assert result.exit_code != 0 and "connected" not in result.stdout
    assert network_namespace_available() or "network access is disabled" in result.stderr


def test_files_stay_in_a_temporary_folder_and_output_is_capped() -> None:
    result = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())")
    folder = result.stdout.strip()
    assert result.exit_code == 0 and "art-sandbox-" in folder and not Path(folder).exists()
    assert len(run_python("print('y' * 100000)", max_output=1000).stdout) == 1000
    environment = run_python("import os\nprint(' '.join(sorted(os.environ)))").stdout.split()
    assert set(environment) <= {"HOME", "PATH", "TMPDIR", "LC_CTYPE"}  # Python itself sets LC_CTYPE
