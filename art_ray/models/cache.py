"""Where prepared models live, and building one exactly once even when several processes ask at once."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

MODELS_DIR_ENV = "ART_RAY_MODELS_DIR"
MARKER_FILE = "art_ray_model.json"


def models_dir() -> Path:
    """The cache root: $ART_RAY_MODELS_DIR, else $XDG_CACHE_HOME/art-ray/models (~/.cache by default)."""
    configured = os.environ.get(MODELS_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_home / "art-ray" / "models"


def _is_complete(path: Path, recipe: dict) -> bool:
    marker = path / MARKER_FILE
    return marker.is_file() and json.loads(marker.read_text()) == recipe


def build_once(name: str, recipe: dict, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """Return `{root}/{name}`, calling `build(tmp_dir)` first unless a build of the same recipe exists.

    The build writes into a temporary folder that is renamed into place, under a file lock, so a
    crashed build never leaves a half-written model and concurrent callers build it once.
    """
    root = models_dir() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if _is_complete(target, recipe):
        return target
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target, recipe):
            return target
        staging = root / f".{name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            build(staging)
            (staging / MARKER_FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
