"""The step's shared prefix computed once: a trainer rank's update equals the one with the prefix in
every row (tests/step_prefix_driver.py, in its own process: DeepSpeed's process group is global)."""

from __future__ import annotations

import pytest
from drivers import run_driver


@pytest.mark.slow
def test_a_rank_trains_through_a_step_prefix_computed_once_as_through_one_in_every_row() -> None:
    results = run_driver("step_prefix_driver.py")
    for name, result in results.items():
        assert result["prefix"] == [48, 0], (name, result)  # the 48 system tokens, then none
        assert result["rows"][0] < result["rows"][1], (name, result)  # rows hold more without it
        assert result["moved"] > 5e-3, (name, result)
        # without the prefix's backward (its gradient dropped) the difference is ~2x what the adapter moved
        assert result["max_difference"] < 1e-4, (name, result)
