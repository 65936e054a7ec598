"""The LoRA registry: a named, detached Ray actor that knows, per model, the adapter versions and who
serves them. Trainer and serving meet only here.

The straight line of an adapter: the trainer's rank 0 packs the tensors and tells the registry, which
fetches them from rank 0 (`captured_adapter`): the one object that call creates is owned by the registry,
the caller, so a version outlives the trainer that made it (Ray 2.56 has no `ray.put(_owner=)`), and the
tensors never pass through the driver. `publish` records
the version at once and pushes it to every replica of every subscribed Serve deployment
(`DeploymentHandle.broadcast`); its result (awaited only by callers that need it) says how many replicas
serve the version. Catching up is the replicas' own: they load the kept versions before taking traffic,
and a version they are asked for by name (`model@step`) but do not have yet is fetched from here on the
spot. The inference app's builder creates the registry (`ensure_registry`); everyone else looks it up.

A registry that dies is restarted by Ray (its handles stay valid, calls in flight are retried) and takes
its subscriptions back from Serve: every running app with an inference deployment. The tensors it owned
die with it; it takes the versions back from the replicas that serve them (each reads its copy back from
its disk) before it answers anything, so a replica that starts later still catches up on every kept
version. A publish never passes for served when a replica of its base model does not serve it: it raises
PublishError.

The registry also keeps the run keys and run owners (art_ray/access.py) and pushes each change to every
replica before the call returns; a restarted registry takes the newest table back from the replicas.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pydantic
import ray
from ray.serve.exceptions import RayServeException

from art_ray.access import AccessTable, KeyGrant
from art_ray.adapters.lora_files import PackedAdapter, pack_adapter
from art_ray.adapters.spec import LoRASpec, validate_model_name
from art_ray.cluster_actors import ensure_cluster_actor, get_cluster_actor
from art_ray.releases import Release

logger = logging.getLogger(__name__)

REGISTRY_NAME = "art_ray_lora_registry"
# The Serve deployment the registry pushes to (art_ray/serving/replica.py)
INFERENCE_DEPLOYMENT = "InferenceReplica"
# How long a restarted registry waits for its replicas to hand back the versions they serve
RECOVERY_TIMEOUT_S = 60.0


class PublishError(RuntimeError):
    """A version reached fewer replicas of its base model than are live."""


class AdapterVersion(pydantic.BaseModel):
    """One published LoRA version. `tensors` is an ObjectRef to a PackedAdapter (PEFT state-dict keys)."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, frozen=True)

    model: str
    step: int = pydantic.Field(ge=0)
    base_model: str
    lora: LoRASpec
    tensors: Any  # ray.ObjectRef; pydantic has no schema for it
    published_at: float = pydantic.Field(default_factory=time.time)


class Subscription(pydantic.BaseModel):
    app_name: str
    deployment_name: str


@ray.remote(num_cpus=0, max_concurrency=64)
class LoRARegistry:
    def __init__(self) -> None:
        self._versions: dict[str, dict[int, AdapterVersion]] = {}
        self._access = AccessTable()
        self._subscriptions: dict[tuple[str, str], Subscription] = {}
        # Building a handle starts a router and its long poll (~100 ms): keep one per deployment.
        self._handles: dict[tuple[str, str], Any] = {}
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._recovery: asyncio.Lock | None = None
        if self._restarted:
            self._subscribe_serves_apps()

    async def _recovered(self) -> None:
        """After a restart, before the first answer: the versions back from the replicas that serve them."""
        if not self._restarted:
            return
        self._recovery = self._recovery or asyncio.Lock()
        async with self._recovery:
            if not self._restarted:
                return
            try:
                held = await self._broadcast_call("held_adapters", (), RECOVERY_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - a registry that answers beats one that waits forever
                logger.warning("registry restarted: taking versions back from the replicas failed: %s", error)
                held = []
            try:
                tables = await self._broadcast_call("access_table", (), RECOVERY_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001
                logger.warning("registry restarted: taking the keys back from the replicas failed: %s", error)
                tables = []
            self._access = max([self._access, *tables], key=lambda table: table.version)
            for version, packed in (item for replica in held for item in replica):
                versions = self._versions.setdefault(version.model, {})
                if version.step not in versions:
                    versions[version.step] = version.model_copy(update={"tensors": ray.put(packed)})
            self._restarted = False
            logger.warning(
                "registry restarted: took back %s",
                {model: sorted(steps) for model, steps in self._versions.items()},
            )

    def _subscribe_serves_apps(self) -> None:
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        try:
            applications = serve.status().applications
        except RayServeException:  # Serve does not run: nothing to push to
            return
        for app_name, app in applications.items():
            if INFERENCE_DEPLOYMENT in app.deployments and app.status != ApplicationStatus.DELETING:
                self.subscribe(app_name, INFERENCE_DEPLOYMENT)
        logger.warning("registry restarted: subscribed %s", sorted(a for a, _ in self._subscriptions))

    def subscribe(self, app_name: str, deployment_name: str) -> None:
        self._subscriptions[(app_name, deployment_name)] = Subscription(
            app_name=app_name, deployment_name=deployment_name
        )

    def unsubscribe(self, app_name: str, deployment_name: str) -> None:
        self._subscriptions.pop((app_name, deployment_name), None)
        self._handles.pop((app_name, deployment_name), None)

    async def latest(self, model: str) -> AdapterVersion | None:
        await self._recovered()
        versions = self._versions.get(model)
        return versions[max(versions)] if versions else None

    async def latest_versions(self) -> list[AdapterVersion]:
        await self._recovered()
        return [versions[max(versions)] for versions in self._versions.values() if versions]

    async def kept_versions(self) -> list[AdapterVersion]:
        """Every version kept, oldest first per model: what a starting replica loads."""
        await self._recovered()
        return [versions[step] for versions in self._versions.values() for step in sorted(versions)]

    async def get(self, model: str, step: int) -> AdapterVersion | None:
        await self._recovered()
        return self._versions.get(model, {}).get(step)

    async def steps(self, model: str) -> list[int]:
        await self._recovered()
        return sorted(self._versions.get(model, {}))

    async def publish(
        self,
        model: str,
        step: int,
        base_model: str,
        lora: dict,
        source: ray.actor.ActorHandle,
        keep_versions: int,
        timeout_s: float = 300.0,
    ) -> dict[str, int]:
        """Record a version and push it to every live replica; returns {"replicas": n} once they serve
        it. The tensors come from `source.captured_adapter(model, step)` (trainer rank 0): this actor calls
        it, so it owns the one object that call creates, and the version outlives the trainer."""
        return await self._record(
            model,
            step,
            base_model,
            lora,
            source.captured_adapter.remote(model, step),
            keep_versions,
            timeout_s,
        )

    async def publish_packed(
        self,
        model: str,
        step: int,
        base_model: str,
        lora: dict,
        packed: PackedAdapter,
        keep_versions: int,
        timeout_s: float = 300.0,
    ) -> dict[str, int]:
        """`publish` for tools and tests that hold the tensors themselves (a copy this actor owns)."""
        return await self._record(model, step, base_model, lora, ray.put(packed), keep_versions, timeout_s)

    async def _record(
        self,
        model: str,
        step: int,
        base_model: str,
        lora: dict,
        ref: ray.ObjectRef,
        keep_versions: int,
        timeout_s: float,
    ) -> dict[str, int]:
        validate_model_name(model)
        await self._recovered()
        version = AdapterVersion(
            model=model, step=step, base_model=base_model, lora=LoRASpec.model_validate(lora), tensors=ref
        )
        versions = self._versions.setdefault(model, {})
        versions[step] = version
        release = self._access.releases.get(model)
        pinned = set(release.arms().values()) if release is not None else set()  # a release's arms stay
        for old in sorted(versions)[:-keep_versions]:
            if old not in pinned:
                del versions[old]
        replicas = await self._broadcast(version, timeout_s)
        return {"replicas": replicas}

    async def retire(self, model: str, timeout_s: float = 300.0) -> int:
        """Forget every version of `model` and unload them from every replica (a deleted run); returns how
        many replicas were serving it."""
        await self._recovered()
        self._versions.pop(model, None)
        serving = sum(await self._broadcast_call("unload_model", (model,), timeout_s))
        table = self._access.with_owner(model, None).with_traffic(model, False).with_release(model, None)
        await self._set_access(table, timeout_s)
        return serving

    async def access(self) -> AccessTable:
        """Run keys and run owners (art_ray/access.py)."""
        await self._recovered()
        return self._access

    async def add_key(self, digest: str, grant: KeyGrant, timeout_s: float = 300.0) -> None:
        """A run key, by its digest; every replica knows it when this returns. AccessError: name taken."""
        await self._recovered()
        await self._set_access(self._access.with_key(digest, grant), timeout_s)

    async def revoke_key(self, name: str, timeout_s: float = 300.0) -> None:
        """Every replica refuses the key named `name` when this returns; the runs it owned stay owned by the
        name (a new key with that name takes them over)."""
        await self._recovered()
        await self._set_access(self._access.without_key(name), timeout_s)

    async def set_owner(self, model: str, owner: str | None, timeout_s: float = 300.0) -> None:
        """`model` is seen by the run key named `owner` (None: by the admin key only) on every replica when
        this returns."""
        await self._recovered()
        if self._access.owners.get(model) != owner:
            await self._set_access(self._access.with_owner(model, owner), timeout_s)

    async def set_traffic(self, model: str, stored: bool, timeout_s: float = 300.0) -> None:
        """Every replica stores `model`'s served turns in its traffic log (or stops) when this returns."""
        await self._recovered()
        if (model in self._access.traffic) != stored:
            await self._set_access(self._access.with_traffic(model, stored), timeout_s)

    async def set_release(self, model: str, release: Release | None, timeout_s: float = 300.0) -> None:
        """Every replica routes `model`'s bare name by `release` (None: to its newest version) when this
        returns."""
        await self._recovered()
        if self._access.releases.get(model) != release:
            await self._set_access(self._access.with_release(model, release), timeout_s)

    async def release(self, model: str) -> Release | None:
        await self._recovered()
        return self._access.releases.get(model)

    async def _set_access(self, table: AccessTable, timeout_s: float) -> None:
        self._access = table
        await self._broadcast_call("update_access", (table,), timeout_s)

    async def handover(self, base_model: str, action: str, timeout_s: float = 300.0) -> int:
        """Colocated layout: every replica of `base_model` gives its devices to the trainer ("release")
        or takes them back ("reclaim"); returns how many replicas did."""
        results = await self._broadcast_call("handover", (base_model, action), timeout_s)
        return sum(results)

    async def _broadcast(self, version: AdapterVersion, timeout_s: float) -> int:
        """How many replicas serve the version once pushed; PublishError if a live replica of its base
        model does not. Replicas of apps on another base model answer None."""
        answers = await self._broadcast_call("load_adapter", (version,), timeout_s)
        results = [served for served in answers if served is not None]
        serving = sum(version.step in served.get(version.model, []) for served in results)
        if serving < len(results):
            raise PublishError(
                f"{version.model}@{version.step} is served by {serving} of the {len(results)} live replicas "
                f"of {version.base_model}"
            )
        return serving

    async def _broadcast_call(self, method: str, args: tuple, timeout_s: float) -> list[Any]:
        """Call `method` on every replica of every subscribed deployment; one result per replica."""
        from ray import serve

        async def push(subscription: Subscription) -> list[Any]:
            key = (subscription.app_name, subscription.deployment_name)
            try:
                if key not in self._handles:
                    self._handles[key] = serve.get_deployment_handle(
                        subscription.deployment_name, subscription.app_name
                    )
                response = self._handles[key].broadcast(method, *args)
                answers = await response.results_async(timeout_s=timeout_s, return_exceptions=True)
            except RayServeException as error:  # the app was deleted: nobody serves it there any more
                logger.warning("dropping subscription %s: %s", subscription, error)
                self.unsubscribe(subscription.app_name, subscription.deployment_name)
                return []
            # A replica that died during the call serves nothing any more, and the one Serve starts in
            # its place loads the kept versions and the access table before it takes traffic: it is not
            # a live replica this call failed on (the soak's replica kills failed publishes, which the
            # trainer took for its own rank's death)
            died = ray.exceptions.ActorDiedError
            gone = sum(isinstance(answer, died) for answer in answers)
            if gone:
                logger.warning("%s: %d replica(s) of %s died during the call", method, gone, key)
            for answer in answers:
                if isinstance(answer, BaseException) and not isinstance(answer, died):
                    raise answer
            return [answer for answer in answers if not isinstance(answer, BaseException)]

        per_deployment = await asyncio.gather(*(push(s) for s in list(self._subscriptions.values())))
        return [result for results in per_deployment for result in results]


def ensure_registry() -> ray.actor.ActorHandle:
    """Create the cluster's registry unless it runs (detached: it outlives the driver that started it).
    Called where the inference app is built, the one place that needs it first."""
    return ensure_cluster_actor(LoRARegistry, REGISTRY_NAME, max_task_retries=-1)


def get_registry() -> ray.actor.ActorHandle:
    """The running registry; ValueError if no inference app was ever built on this cluster."""
    return get_cluster_actor(REGISTRY_NAME)


async def publish_adapter(
    model: str,
    step: int,
    base_model: str,
    lora: LoRASpec,
    tensors: dict,
    keep_versions: int = 3,
    timeout_s: float = 300.0,
) -> int:
    """Publish a version from this process (tools and tests; the trainer publishes from its rank 0) and
    wait until every live replica serves it; returns the replica count."""
    result = await get_registry().publish_packed.remote(
        model, step, base_model, lora.model_dump(), pack_adapter(tensors), keep_versions, timeout_s
    )
    return result["replicas"]
