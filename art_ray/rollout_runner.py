"""Rollouts as Ray work on any node: `@art_ray.remote_rollout` on the user's agent function.

Calling the decorated function returns an awaitable that runs the function on a pool of async Ray
actors (`num_cpus=0`: an I/O-bound rollout waits on the endpoint, it does not need a CPU, so thousands
run concurrently in a few processes). Sync functions run in the actor's threads, async ones on its
event loop. If the actor or its node dies, the rollout is retried on another actor (`max_retries`);
an exception raised by the user's code is not retried: it is the rollout's result, as on the driver.
In a driver that never connected to Ray (one training through an HTTPBackend) the function runs on the
driver's own event loop instead, so the same script works there.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from art_ray.trajectories import Trajectory

LOST_WORKER_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)


class RolloutRunner:
    """Made remote by the pool (`ray.remote(RolloutRunner)`), so Ray pickles the class by reference."""

    async def run(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if inspect.iscoroutinefunction(function):
            return await function(*args, **kwargs)
        return await asyncio.to_thread(function, *args, **kwargs)

    def pid(self) -> int:
        import os

        return os.getpid()


class RunnerPool:
    """Async actors that share the rollouts round-robin; a dead runner is replaced."""

    def __init__(self, size: int, max_concurrency: int) -> None:
        self._size = size
        self._max_concurrency = max_concurrency
        self._runners: list[Any] = []
        self._next = itertools.count()

    def _new_runner(self) -> Any:
        return (
            ray.remote(RolloutRunner)
            .options(num_cpus=0, max_concurrency=self._max_concurrency, max_restarts=0)
            .remote()
        )

    def reset(self) -> None:
        """Forget the runners (of a Ray session that ended)."""
        self._runners = []

    def runner(self) -> tuple[int, Any]:
        if not self._runners:
            self._runners = [self._new_runner() for _ in range(self._size)]
        index = next(self._next) % len(self._runners)
        return index, self._runners[index]

    def replace(self, index: int, dead: Any) -> None:
        if self._runners[index] is dead:
            self._runners[index] = self._new_runner()

    @property
    def runners(self) -> list[Any]:
        return list(self._runners)


def remote_rollout(
    function: Callable[..., Any] | None = None,
    *,
    max_retries: int = 3,
    num_runners: int = 2,
    max_concurrency: int = 1000,
) -> Any:
    """Decorate a rollout function (sync or async) so each call runs as Ray work, with retries for lost
    workers. Usable bare (`@remote_rollout`) or with options (`@remote_rollout(max_retries=5)`)."""

    def decorate(user_function: Callable[..., Any]) -> Callable[..., Awaitable[Trajectory]]:
        pool = RunnerPool(num_runners, max_concurrency)
        function_ref: list[Any] = []
        session: list[tuple[str, str]] = []

        @functools.wraps(user_function)
        async def call(*args: Any, **kwargs: Any) -> Trajectory:
            if not ray.is_initialized():  # a driver without Ray (an HTTPBackend's): run it right here
                return await RolloutRunner().run(user_function, args, kwargs)
            context = ray.get_runtime_context()
            current = (context.get_job_id(), context.get_node_id())
            if session != [current]:  # a new Ray session (another backend): the old refs and runners are gone
                session[:] = [current]
                function_ref.clear()
                pool.reset()
            if not function_ref:  # serialized once, then shared by every call
                function_ref.append(ray.put(user_function))
            for attempt in range(max_retries + 1):
                index, runner = pool.runner()
                try:
                    return await runner.run.remote(function_ref[0], args, kwargs)
                except LOST_WORKER_ERRORS:
                    pool.replace(index, runner)
                    if attempt == max_retries:
                        raise
            raise AssertionError("unreachable")

        call.pool = pool  # type: ignore[attr-defined]
        return call

    return decorate(function) if function is not None else decorate


def captured_rollout(
    function: Callable[..., Any] | None = None,
    *,
    ttl_s: float | None = None,
    max_retries: int = 3,
    num_runners: int = 2,
    max_concurrency: int = 1000,
) -> Any:
    """A remote rollout whose trajectory the endpoint records (capture sessions): decorate an agent that
    takes a CaptureSession first (give any framework `session.base_url` and `session.api_key`) and returns
    its reward, or (reward, metrics). Calling it with the model first, `await agent(model, *args)`, opens
    a session, runs the agent as Ray work and returns the recorded Trajectory. A retry after a lost worker
    starts in a new session."""

    def decorate(agent: Callable[..., Any]) -> Callable[..., Awaitable[Trajectory]]:
        @functools.wraps(agent)
        async def run_captured(model: Any, *args: Any, **kwargs: Any) -> Trajectory:
            from art_ray.capture.session import capture_session

            async with capture_session(model, ttl_s) as session:
                if inspect.iscoroutinefunction(agent):
                    result = await agent(session, *args, **kwargs)
                else:
                    result = await asyncio.to_thread(agent, session, *args, **kwargs)
                reward, metrics = result if isinstance(result, tuple) else (result, None)
                return await session.trajectory(reward=reward, metrics=metrics)

        return remote_rollout(
            run_captured, max_retries=max_retries, num_runners=num_runners, max_concurrency=max_concurrency
        )

    return decorate(function) if function is not None else decorate
