"""Rewards from tests: hidden tests go into the box after the episode (never before: the model would read
them), run there, and score. A failure of the sandbox is `infra_error`, which a trainer drops from its group
rather than scoring 0."""

from __future__ import annotations

from typing import Literal

import pydantic

from art_ray.errors import SandboxError
from art_ray.sandbox.types import ExecResult, LeasedSandbox


class TestOutcome(pydantic.BaseModel):
    __test__ = False  # not a pytest class

    status: Literal["passed", "failed", "infra_error"]
    result: ExecResult | None = None
    error: str | None = None

    @property
    def reward(self) -> float | None:
        """1.0 or 0.0; None for an infra error (drop the sample, do not score it)."""
        return None if self.status == "infra_error" else float(self.status == "passed")


async def run_tests(
    box: LeasedSandbox, files: dict[str, str | bytes], command: str, timeout_s: float | None = None
) -> TestOutcome:
    """Write `files` (path -> content) into the box, run `command`; passed when it exits 0 in time."""
    try:
        for path, content in files.items():
            await box.write_file(path, content)
        result = await box.run(command, timeout_s)
    except SandboxError as error:
        return TestOutcome(status="infra_error", error=repr(error))
    return TestOutcome(status="passed" if result.ok else "failed", result=result)
