"""The quickstart's code, run as written: docs/quickstart.md's Python block saved as first_agent.py and its
command run in a fresh folder, as a reader does after `make setup`. The script starts its own Ray cluster,
serves SmolLM2-135M-Instruct, trains two GRPO steps and shuts down; the test checks it printed both steps
and left the checkpoint, the Parquet files and the MLflow store where the page says.

It needs no session cluster, so it runs in the first block of the suite (tests/conftest.py), with the
machine to itself; most of its time is the cluster's, the engine's and the trainer's start.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
RUN_MARKER = "<!-- run by tests/test_docs_quickstart.py -->"


def marked_blocks(page: Path, marker: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after a `marker` line, in page order."""
    pattern = re.escape(marker) + r"\n```(\w+)\n(.*?)\n```"
    return re.findall(pattern, page.read_text(), flags=re.S)


def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    blocks = marked_blocks(PAGE, RUN_MARKER)
    assert [language for language, _ in blocks] == ["python", "bash"], blocks
    (_, script), (_, command) = blocks
    assert "first_agent.py" in command
    (tmp_path / "first_agent.py").write_text(script + "\n")
    # the command names the checkout's .venv; here it is the interpreter running the tests
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert re.search(r"^step 1: mean reward [01]\.\d\d$", done.stdout, flags=re.M), output[-6000:]
    assert re.search(r"^step 2: mean reward [01]\.\d\d$", done.stdout, flags=re.M), output[-6000:]
    # where the page says: a complete step-2 checkpoint, the trained groups' Parquet, the MLflow store
    run = tmp_path / "art_ray_runs" / "quickstart" / "models" / "my-agent"
    assert (run / "checkpoints" / "0002" / "trainer_state.json").is_file(), sorted(run.rglob("*"))
    assert (run / "checkpoints" / "0002" / "adapter").is_dir()
    assert sorted(p.name for p in (run / "trajectories" / "train").glob("*.parquet")) == [
        "0000.parquet",
        "0001.parquet",
    ]
    assert (tmp_path / "art_ray_runs" / "mlflow.db").is_file()
