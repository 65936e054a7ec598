"""A run's release on the connected cluster: read, moved by hand, or checked against its traffic.

The release lives in the LoRA registry's table, which every inference replica hears from at once (one
push: a rollback takes effect on every replica when `act` returns). Its evidence lives in the run's
traffic log (`TrafficLog.arm_stats`). RayBackend's release methods, the training server's route and
`art-ray release` call `act`; the arithmetic is art_ray/releases.py's.
"""

from __future__ import annotations

import ray

from art_ray.adapters.registry import ensure_registry
from art_ray.errors import ReleaseError
from art_ray.releases import (
    ArmStats,
    Decision,
    Release,
    ReleaseAction,
    ReleasePolicy,
    ReleaseState,
    apply,
    decide,
    start_canary,
)


async def begin(model: str, stable: int, policy: ReleasePolicy) -> Release:
    """Give `model` a release with `stable` as its stable step, unless it has one (kept as it is)."""
    registry = ensure_registry()
    existing = await registry.release.remote(model)
    if existing is not None:
        return existing
    release = Release(model=model, stable=stable, policy=policy, reason=f"step {stable} stable")
    await registry.set_release.remote(model, release)
    return release


async def act(model: str, action: ReleaseAction) -> ReleaseState:
    """Apply `action` to `model`'s release; the state after it."""
    registry = ensure_registry()
    release = await registry.release.remote(model)
    arms = await _arm_stats(model)
    if action.action == "status":
        return ReleaseState(release=release, arms=arms, decision=decide(release, arms) if release else None)
    if release is None:
        raise ReleaseError(f"model {model!r} has no release: set ModelConfig.release when registering it")
    decision = None
    if action.action == "start":
        published = await registry.steps.remote(model)
        step = action.step if action.step is not None else max(published, default=0)
        if step not in published:
            raise ReleaseError(f"{model}@{step} was never published")
        if step in release.rejected or step == release.stable:
            raise ReleaseError(f"{model}@{step} is the stable step or was rolled back")
        updated = start_canary(release, step)
    elif action.action == "check":
        decision = decide(release, arms)
        updated = apply(release, decision)
    elif action.action in ("promote", "rollback"):
        if release.candidate is None:
            raise ReleaseError(f"model {model!r} has no candidate to {action.action}")
        reason = action.reason or f"{action.action} by hand"
        decision = Decision(action=action.action, reason=reason)
        updated = apply(release.model_copy(update={"status": "canary"}), decision)
    elif action.action == "pause":
        if release.status != "canary":
            raise ReleaseError(f"model {model!r} has no canary to pause ({release.status})")
        updated = release.model_copy(update={"status": "paused", "reason": action.reason or "paused by hand"})
    else:  # resume
        if release.status != "paused":
            raise ReleaseError(f"model {model!r} is not paused ({release.status})")
        updated = release.model_copy(update={"status": "canary", "reason": action.reason or "resumed"})
    if updated != release:
        await registry.set_release.remote(model, updated)
    return ReleaseState(release=updated, arms=arms, decision=decision)


async def reject_descendants(model: str, rejected: int, through: int, state: ReleaseState) -> ReleaseState:
    """Roll back, with `rejected`, every published step after it up to `through`: they were trained on its
    weights (the trainer moves back to the stable step's only at the rollback)."""
    registry = ensure_registry()
    release = await registry.release.remote(model)
    published = await registry.steps.remote(model)
    descendants = [step for step in sorted(published) if rejected < step <= through]
    extra = [step for step in descendants if step not in release.rejected]
    if not extra:
        return state.model_copy(update={"release": release})
    if release.candidate in extra:  # a canary of a descendant (started by hand) ends with it
        release = release.model_copy(update={"candidate": None, "share": 0.0, "status": "rolled_back"})
    updated = release.model_copy(update={"rejected": (*release.rejected, *extra)})
    await registry.set_release.remote(model, updated)
    return state.model_copy(update={"release": updated})


async def _arm_stats(model: str) -> dict[int, ArmStats]:
    from art_ray.traffic.log import get_traffic_log

    try:
        log = get_traffic_log(model)
    except ValueError:  # the run stores no traffic: nothing to compare
        return {}
    try:
        return await log.arm_stats.remote()
    except ray.exceptions.RayError:
        return {}
