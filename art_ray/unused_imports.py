"""Packages installed beside art-ray that a trainer rank or an inference replica never uses but would
import at start: transformers imports scikit-learn for assisted generation's candidate generator
(transformers/generation/candidate_generator.py, on every `AutoModel` and on vLLM's config), and
DeepSpeed's autotuner imports MLflow (deepspeed/autotuning/autotuner.py) whenever it is installed.
Together they cost a trainer rank's process ~12 s of its ~24 s of imports on the 2-core box, and a
replica's ~5 s (measured while every process still compiled its imports from source, before `make setup`
compiled bytecode).

Marking them absent (`None` in `sys.modules`) makes `importlib.util.find_spec` report them missing and
`import` raise ImportError, which both libraries handle as "not installed". Only actor processes that
art-ray owns call this: a driver or a rollout may use either package."""

from __future__ import annotations

import sys

NEVER_USED_IN_ACTORS = ("sklearn", "mlflow")


def skip_unused_imports() -> None:
    """In this process, treat the never-used packages as absent (one already imported stays)."""
    for name in NEVER_USED_IN_ACTORS:
        sys.modules.setdefault(name, None)
