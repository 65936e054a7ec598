"""The cluster's one-of-a-kind actors (the LoRA registry, the capture store, the response store): each is
named in art-ray's namespace, detached so it outlives whoever created it first, and restarted by Ray when
it dies."""

from __future__ import annotations

from typing import Any

import ray

NAMESPACE = "art_ray"


def ensure_cluster_actor(actor_class: Any, name: str, *args: Any, **options: Any) -> ray.actor.ActorHandle:
    """The running actor called `name`, or a new one of `actor_class(*args)` if none runs."""
    return actor_class.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1, **options
    ).remote(*args)


def get_cluster_actor(name: str) -> ray.actor.ActorHandle:
    """The running actor called `name`; ValueError if none runs."""
    return ray.get_actor(name, namespace=NAMESPACE)
