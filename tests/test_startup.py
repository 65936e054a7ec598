"""Registering starts a model's parts side by side (art_ray/startup.py): each part runs to its end,
failures come back as results, and the output says what is still starting."""

from __future__ import annotations

import asyncio
import time

import pytest

from art_ray.startup import side_by_side


async def ready_after(seconds: float, value: str) -> str:
    await asyncio.sleep(seconds)
    return value


async def fails_after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    raise RuntimeError("no engine")


def test_parts_run_side_by_side_and_say_what_is_still_starting() -> None:
    lines: list[str] = []
    started = time.monotonic()
    results = asyncio.run(
        side_by_side(
            {
                "app": ready_after(0.6, "url"),
                "trainer": ready_after(0.3, "group"),
                "MLflow": ready_after(0, "run"),
            },
            lines.append,
        )
    )
    assert time.monotonic() - started < 0.9  # not 0.9 s one after another
    assert results == {"app": "url", "trainer": "group", "MLflow": "run"}
    assert lines[0] == "starting app, trainer, MLflow side by side"
    assert lines[1].startswith("MLflow ready") and lines[1].endswith("still starting: app, trainer")
    assert lines[2].startswith("trainer ready") and lines[2].endswith("still starting: app")
    assert lines[3].startswith("app ready") and "still" not in lines[3]


def test_a_failed_part_is_a_result_and_the_others_finish() -> None:
    lines: list[str] = []
    finished: list[str] = []

    async def trainer() -> str:
        await asyncio.sleep(0.3)
        finished.append("trainer")
        return "group"

    results = asyncio.run(side_by_side({"app": fails_after(0.1), "trainer": trainer()}, lines.append))
    assert isinstance(results["app"], RuntimeError) and results["trainer"] == "group"
    assert finished == ["trainer"]  # still started, so the caller can stop it
    assert lines[1].startswith("app failed (RuntimeError)") and lines[1].endswith("still starting: trainer")


@pytest.mark.parametrize("count", [0, 1])
def test_one_part_or_none_prints_no_side_by_side_line(count: int) -> None:
    lines: list[str] = []
    parts = {f"part {i}": ready_after(0, "done") for i in range(count)}
    assert len(asyncio.run(side_by_side(parts, lines.append))) == count
    assert not any("side by side" in line for line in lines)
