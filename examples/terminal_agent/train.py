"""A terminal agent with GRPO on art-ray: in a leased sandbox holding a small repository whose test fails,
the model works with tool calls (`bash`, `str_replace_editor` from art_ray.sandbox's agent tools, and
`submit`), one call a turn, at most MAX_TURNS turns; then a hidden check (more cases than the visible
test) grades what it left in calc.py.

    python examples/terminal_agent/train.py --steps 3

Reward: 1 if the hidden check passes; else 0.1 if the agent ran the tests. A failure of the sandbox
itself raises SandboxError: the rollout fails and its sample is dropped, never scored 0. Metrics: correct
(the hidden check passed), ran_tests, edited,
submitted, turns, tool_errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from loop import AgentTask, main, tool_turn  # noqa: E402
from repos import (  # noqa: E402
    MODULE,
    TEST_COMMAND,
    VISIBLE_TEST,
    Repo,
    held_out_repos,
    hidden_check,
    make_repo,
    passed,
)

import art_ray  # noqa: E402
from art_ray import TrainableModel, TrainConfig, Trajectory  # noqa: E402
from art_ray.sandbox import SandboxLimits, SandboxTools, SharedSandboxes  # noqa: E402

SANDBOXES = SharedSandboxes(
    name="terminal-agent-sandboxes",
    # a rollout holds its box while the model thinks: enough slots for a step's rollouts to overlap
    slots=16,
    limits=SandboxLimits(wall_s=10, cpu_s=10, memory_mb=512, processes=32, output_bytes=2048),
    first_uid=140000,  # apart from code_math's (120000) and the tests' (170000-172999)
)


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


# art-ray's bash and str_replace_editor (answered by SandboxTools, whose argument models accept these
# calls), with only the fields this task needs: the full schemas take ~550 of a 135M model's tokens
TEXT = {"type": "string"}
TOOLS = [
    function("bash", "Run a bash command in /workspace.", {"command": TEXT}, ["command"]),
    function(
        "str_replace_editor",
        "view a file, or str_replace: replace old_str (found once) by new_str in path.",
        {
            "command": {"type": "string", "enum": ["view", "str_replace"]},
            "path": TEXT,
            "old_str": TEXT,
            "new_str": TEXT,
        },
        ["command", "path"],
    ),
    function("submit", "End the task once the test passes.", {}, []),
]
SYSTEM = (
    "You are a programmer working in a terminal, in the folder /workspace. Use the tools: bash runs a "
    "command, str_replace_editor edits a file (command str_replace with path, old_str and new_str). Make "
    "the failing test pass by changing calc.py, never the test, then call submit."
)
MAX_TURNS, MAX_TOKENS = 3, 160
LEASE_TTL_S = 300.0


def task_message(repo: Repo, test_output: str) -> str:
    return (
        f"The test in {VISIBLE_TEST} fails.\n\n{MODULE}:\n```python\n{repo.source}```\n\n"
        f"{VISIBLE_TEST}:\n```python\n{repo.files[VISIBLE_TEST]}```\n\n`{TEST_COMMAND}` says:\n{test_output}"
    )


@art_ray.remote_rollout
async def rollout(model: TrainableModel, repo: Repo, temperature: float) -> Trajectory:
    async with SANDBOXES.lease(LEASE_TTL_S) as box:
        for path, content in repo.files.items():
            await box.write_file(path, content)
        failing = await box.run(TEST_COMMAND)
        tools = SandboxTools(box)
        messages: list = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task_message(repo, failing.stdout[-600:])},
        ]
        turns = errors = 0
        ran_tests = submitted = False
        while turns < MAX_TURNS and not submitted:
            turns += 1
            choice = await tool_turn(
                model, messages, TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, temperature=temperature
            )
            if choice is None:  # the conversation outgrew max_model_len
                break
            calls = choice.message.tool_calls or []
            if not calls:  # cut off by max_tokens, or no readable call
                errors += 1
                break
            for call in calls:
                if call.function.name == "submit":
                    submitted = True
                    answer = "submitted"
                else:
                    ran_tests = ran_tests or "pytest" in (call.function.arguments or "")
                    reply = await tools.answer(call.function.name, call.function.arguments or "{}")
                    errors += reply.is_error
                    answer = reply.content
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        edited = (await box.read_file(MODULE)).decode(errors="replace") != repo.source
        check, token = hidden_check(repo)
        await box.write_file(".hidden_check.py", check)
        graded = await box.run("python -I .hidden_check.py")
    ok = passed(graded.stdout, graded.exit_code, token)
    reward = 1.0 if ok else 0.1 if ran_tests else 0.0
    metrics = {
        "correct": float(ok),
        "ran_tests": float(ran_tests),
        "edited": float(edited),
        "submitted": float(submitted),
        "turns": float(turns),
        "tool_errors": float(errors),
    }
    return Trajectory(messages_and_choices=messages, tools=TOOLS, reward=reward, metrics=metrics)


TASK = AgentTask(
    name="terminal_agent",
    rollout=rollout,
    train_scenarios=make_repo,
    val_scenarios=held_out_repos(16),
    metrics=["correct", "ran_tests", "edited", "submitted", "turns", "tool_errors"],
    train_temperature=1.0,
    train_config=TrainConfig(scale_rewards=False),
    # the two tools' schemas take ~450 tokens, the task ~200, three turns of calls and answers ~900
    max_model_len=1792,
)

if __name__ == "__main__":
    main(TASK, __doc__)
