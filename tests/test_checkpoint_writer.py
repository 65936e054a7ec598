"""The background checkpoint writer: what `save` snapshots is what lands on disk, whatever training does
to the originals afterwards; writes keep their order; a write's error reaches `wait`."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from art_ray.trainer.checkpoint_writer import BackgroundCheckpointEngine, snapshot


def test_a_snapshot_does_not_follow_the_original() -> None:
    weight = torch.zeros(3)
    state = OrderedDict(module={"w": weight}, optimizer={"state": [weight, (weight, 1)]}, step=4)
    copied = snapshot(state)
    weight += 1  # the next optimizer step, in place
    state["optimizer"]["state"].append("later")
    assert isinstance(copied, OrderedDict) and copied["step"] == 4
    assert torch.equal(copied["module"]["w"], torch.zeros(3))
    assert torch.equal(copied["optimizer"]["state"][1][0], torch.zeros(3))
    assert len(copied["optimizer"]["state"]) == 2


def test_files_hold_the_state_at_save_time_and_wait_until_they_are_written(tmp_path) -> None:
    writer = BackgroundCheckpointEngine()
    gate = threading.Event()
    writer.submit(gate.wait)  # the writer is busy: the saves below are only queued
    weight = torch.ones(2)
    writer.save({"w": weight}, str(tmp_path / "a.pt"))
    weight.mul_(5)
    writer.save({"w": weight}, str(tmp_path / "b.pt"))
    assert not (tmp_path / "a.pt").exists()
    gate.set()
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.ones(2))
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.full((2,), 5.0))


def test_a_failed_write_raises_in_wait(tmp_path) -> None:
    writer = BackgroundCheckpointEngine()
    writer.save({"w": torch.ones(1)}, str(tmp_path / "missing-folder" / "a.pt"))
    with pytest.raises(FileNotFoundError):
        writer.wait()
    writer.wait()  # reported once; the writer goes on
