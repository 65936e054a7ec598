"""examples/code_math: problems, answer extraction, reward, and where the programs run: art-ray's sandbox
pool (a local pool without Ray; the job's named host actor on Ray), under the example's limits."""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "code_math"))

import execute  # noqa: E402
from problems import extract_code, make_problem, printed_number, score  # noqa: E402


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


def run_locally(code: str):  # noqa: ANN201
    """The pool a driver without Ray uses (run_program's own path when Ray is not initialized)."""
    return execute.run_program_blocking(code)


def test_a_program_runs_and_its_output_comes_back() -> None:
    result = run_locally("a = 6\nb = 7\nprint(a * b)")
    assert (result.stdout, result.exit_code, result.timed_out) == ("42\n", 0, False)


def test_an_endless_loop_times_out_at_the_limit() -> None:
    result = run_locally("while True:\n    pass")
    assert result.timed_out and result.exit_code is None
    assert execute.SANDBOXES.limits.wall_s <= result.duration_s < execute.SANDBOXES.limits.wall_s + 2


def test_a_memory_bomb_fails_inside_the_limit() -> None:
    result = run_locally("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert result.exit_code != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_no_network_and_no_host_files() -> None:
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nprint('connected')"
    result = run_locally(code)
    assert result.exit_code != 0 and "connected" not in result.stdout
    marker = f"artray-code-math-{uuid.uuid4().hex}"
    result = run_locally(f"open('/tmp/{marker}', 'w').write('x')\nprint(open('/etc/hostname').read())")
    assert result.stdout == "sandbox\n\n" and not Path(f"/tmp/{marker}").exists()


def test_output_is_cut_while_it_is_read_and_leases_do_not_share_files() -> None:
    result = run_locally("print('y' * 100000)")
    assert len(result.stdout) == execute.SANDBOXES.limits.output_bytes and result.truncated
    assert run_locally("open('left.txt', 'w').write('x')").exit_code == 0
    assert "FileNotFoundError" in run_locally("open('left.txt').read()").stderr  # the workspace was reset


@pytest.mark.slow
async def test_rollout_runners_share_the_jobs_sandbox_host(ray_cluster) -> None:  # noqa: ANN001
    """On Ray, programs lease from one named host actor however many callers start it."""
    import ray

    results = await asyncio.gather(*(execute.run_program(f"print({i} * 2)") for i in range(6)))
    assert [result.stdout for result in results] == [f"{i * 2}\n" for i in range(6)]
    hosts = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == execute.SANDBOXES.name
    ]
    assert len(hosts) == 1
