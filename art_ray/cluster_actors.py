"""The cluster's one-of-a-kind actors (the LoRA registry, the capture store, the response store): each is
named in art-ray's namespace, detached so it outlives whoever created it first, and restarted by Ray when
it dies."""

from __future__ import annotations

from typing import Any

import ray

NAMESPACE = "art_ray"
# The long-lived actors' calls (a publish per step, a store per captured turn, a rank's calls per step) are
# not recorded as Ray task events: the GCS keeps up to 100,000 of them (~5 KB each), so a deployment up for
# a day grew its GCS by ~2 MB a minute (bench/soak.py). Serve leaves them off for its own actors as well
# (RAY_SERVE_ENABLE_TASK_EVENTS); the actors' logs and errors are unchanged.
LONG_LIVED_OPTIONS: dict[str, Any] = {"enable_task_events": False}


def ensure_cluster_actor(actor_class: Any, name: str, *args: Any, **options: Any) -> ray.actor.ActorHandle:
    """The running actor called `name`, or a new one of `actor_class(*args)` if none runs."""
    return actor_class.options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        **LONG_LIVED_OPTIONS,
        **options,
    ).remote(*args)


def get_cluster_actor(name: str) -> ray.actor.ActorHandle:
    """The running actor called `name`; ValueError if none runs."""
    return ray.get_actor(name, namespace=NAMESPACE)
