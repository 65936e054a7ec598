"""examples/terminal_agent: the generated repositories, the hidden check (run in a sandbox: it passes a
fixed module only, and not one that exits early), an episode scripted through the agent tools, and one
rollout of SmolLM2 through the rollout runners and the job's sandbox host."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "terminal_agent"))

from repos import MODULE, OPERATORS, TEST_COMMAND, held_out_repos, hidden_check, make_repo, passed  # noqa: E402

from art_ray.sandbox import SandboxLimits, SandboxPool, SandboxTools  # noqa: E402
from art_ray.sandbox.namespaces import NamespaceBackend  # noqa: E402

FIRST_UID = 173000  # apart from the other sandbox tests'


def fixed(repo) -> str:  # noqa: ANN001
    return f"def {repo.function}(a, b):\n    return a {repo.operator} b\n"


def test_repositories_are_seeded_and_fail_as_given() -> None:
    assert make_repo(random.Random(5)) == make_repo(random.Random(5))
    repos = held_out_repos(40)
    assert {repo.kind for repo in repos} == {"fix", "write"} and {repo.operator for repo in repos} == set(
        OPERATORS
    )
    for repo in repos:
        if repo.kind == "fix":
            assert f"return a {repo.operator} b" not in repo.source
        else:
            assert "NotImplementedError" in repo.source
    assert held_out_repos(3) == held_out_repos(3)


def test_passed_needs_the_token_last_and_exit_zero() -> None:
    assert passed("x\nabc\n", 0, "abc") and not passed("abc\nx\n", 0, "abc") and not passed("abc", 1, "abc")
    assert not passed("", 0, "abc")


async def test_the_hidden_check_passes_a_fixed_module_only() -> None:
    repo = held_out_repos(1)[0]
    async with SandboxPool(2, SandboxLimits(wall_s=10), NamespaceBackend(FIRST_UID)) as pool:
        outcomes = []
        for module in (repo.source, fixed(repo), "import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n"):
            async with pool.lease() as box:
                for path, content in repo.files.items():
                    await box.write_file(path, content)
                await box.write_file(MODULE, module)
                check, token = hidden_check(repo)
                await box.write_file(".hidden_check.py", check)
                result = await box.run("python -I .hidden_check.py")
                outcomes.append(passed(result.stdout, result.exit_code, token))
    assert outcomes == [False, True, False, False]


async def test_an_episode_through_the_agent_tools() -> None:
    """What a model that solves the task calls: run the tests, replace the line, run them again."""
    repo = next(repo for repo in held_out_repos(20) if repo.kind == "fix")
    wrong = next(line for line in repo.source.splitlines() if line.strip().startswith("return"))
    pool = SandboxPool(1, SandboxLimits(wall_s=20), NamespaceBackend(FIRST_UID))
    async with pool, pool.lease() as box:
        for path, content in repo.files.items():
            await box.write_file(path, content)
        tools = SandboxTools(box)
        before = await tools.answer("bash", {"command": TEST_COMMAND})
        edit = {
            "command": "str_replace",
            "path": MODULE,
            "old_str": wrong,
            "new_str": f"    return a {repo.operator} b",
        }
        edited = await tools.answer("str_replace_editor", json.dumps(edit))
        after = await tools.answer("bash", {"command": TEST_COMMAND})
        check, token = hidden_check(repo)
        await box.write_file(".hidden_check.py", check)
        graded = await box.run("python -I .hidden_check.py")
    assert "1 failed" in before.content and not edited.is_error and "1 passed" in after.content
    assert passed(graded.stdout, graded.exit_code, token)


@pytest.mark.slow
async def test_one_rollout_of_smollm2_runs_in_the_jobs_sandbox_host(smollm2_model) -> None:  # noqa: ANN001
    import ray

    from art_ray import sampled_tokens

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    example = learning.load_example("terminal_agent")
    trajectory = await example.rollout(smollm2_model.model, held_out_repos(1)[0], 1.0)
    assert trajectory.reward in (0.0, 0.1, 1.0)
    assert {
        "correct",
        "ran_tests",
        "edited",
        "submitted",
        "turns",
        "tool_errors",
    } <= trajectory.metrics.keys()
    choices = [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]
    assert choices and all(sampled_tokens(choice).token_ids for choice in choices)  # trainable
    hosts = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert example.SANDBOXES.name in hosts
