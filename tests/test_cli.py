"""The `art-ray` command: help for every command, the job command line `submit` builds, and `status`."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from art_ray.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    ["models", "prepare"],
    ["demo"],
    ["serve"],
    ["serve-training"],
    ["status"],
    ["keys", "create"],
    ["release"],
    ["submit"],
]


def test_the_installed_command_answers_help() -> None:
    """Once as a user runs it (its own process); every subcommand's help below, from the same parser."""
    completed = subprocess.run(
        [sys.executable, "-m", "art_ray.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("usage: art-ray")
    assert all(name[0] in completed.stdout for name in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: art-ray {' '.join(command)}")


def test_submit_puts_the_scripts_folder_on_the_workers_path(capsys) -> None:
    code = main(
        [
            "submit",
            "--dry-run",
            "--address",
            "http://10.0.0.1:8265",
            "--working-dir",
            str(ROOT),
            "--env",
            "HF_HOME=/data",
            "--",
            "python",
            "examples/one_word/train.py",
            "--steps",
            "3",
        ]
    )
    assert code == 0
    parts = shlex.split(capsys.readouterr().out.strip().removeprefix("$ "))
    assert parts[:5] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"]
    assert parts[5:7] == ["--working-dir", str(ROOT)]
    assert parts[7] == "--runtime-env-json"
    assert json.loads(parts[8]) == {"env_vars": {"HF_HOME": "/data", "PYTHONPATH": "examples/one_word"}}
    assert parts[9:] == ["--", "python", "examples/one_word/train.py", "--steps", "3"]


def test_submit_without_an_entrypoint_says_how() -> None:
    with pytest.raises(SystemExit, match="give the entrypoint"):
        main(["submit", "--dry-run"])


def test_demo_passes_its_arguments_to_the_example() -> None:
    args = build_parser().parse_args(["demo", "--storage", "/tmp/x", "--", "--steps", "2"])
    assert args.storage == "/tmp/x" and args.demo_args[-2:] == ["--steps", "2"]


@pytest.mark.slow
def test_status_lists_models_and_what_each_replica_serves(inference_app) -> None:
    from art_ray.status import cluster_status, format_status

    status = cluster_status()
    models = {m.model: m for m in status.models}
    assert models[inference_app.model].base_model == inference_app.base_model
    (app,) = [a for a in status.apps if a.app_name == inference_app.app_name]
    assert app.replicas_running == 2 and len(app.replicas) == 2
    latest = models[inference_app.model].latest_step
    assert all(latest in served[inference_app.model] for served in app.replicas)
    text = format_status(status)
    assert f"{inference_app.model}: latest step {latest}" in text and "replica 1:" in text
