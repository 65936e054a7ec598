"""Colocated layout on CPU: the engine and the trainer take turns, each phase on every core, and the
idle side takes no CPU. Measured in CPU seconds of the real processes (the engine's and the trainer
rank's), on SmolLM2 served and trained by the session's `smol` backend (colocated: one box)."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from art_ray import TrainConfig, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.slow


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def idle_seconds() -> float:
    """Idle time of the cores this process may run on (reported: a phase that leaves cores idle)."""
    cores = os.sched_getaffinity(0)
    per_core = psutil.cpu_times(percpu=True)
    return sum(times.idle + getattr(times, "iowait", 0.0) for i, times in enumerate(per_core) if i in cores)


def engine_processes(app_name: str) -> list[psutil.Process]:
    """The app's replica actor and the engine processes it spawned (vLLM's engine core and its worker);
    short-lived helpers a child may start are left out, since they can exit between two readings."""
    for process in psutil.process_iter(["cmdline"]):
        if any(f"ServeReplica:{app_name}:InferenceReplica" in part for part in process.info["cmdline"] or []):
            children = process.children(recursive=True)
            engine = [child for child in children if child.name().startswith("VLLM::")]
            assert engine, "no vLLM engine process under the replica"
            return [process, *engine]
    raise AssertionError(f"no replica process of app {app_name!r}")


async def trainer_process(backend, model) -> psutil.Process:
    worker = backend._trainers[model.name].workers[0]
    return psutil.Process(await worker.__ray_call__.remote(lambda self: os.getpid()))


async def sample_groups(model, prompts: list[str], samples: int) -> list[TrajectoryGroup]:
    client = model.openai_client()

    async def one(prompt: str) -> Trajectory:
        messages = [{"role": "user", "content": prompt}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=24, temperature=1.0
        )
        choice = completion.choices[0]
        return Trajectory(
            messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or ""))
        )

    return [TrajectoryGroup(await asyncio.gather(*(one(p) for _ in range(samples)))) for p in prompts]


async def test_each_phase_gets_every_core_and_the_idle_side_sleeps(smollm2_model) -> None:
    backend, model = smollm2_model.backend, smollm2_model.model
    assert backend._layout == "colocated"
    engine, trainer = engine_processes(backend.app_name), await trainer_process(backend, model)
    cores = len(os.sched_getaffinity(0))

    prompts = ["Describe the sea.", "Describe a forest.", "Describe a city.", "Describe the sky."]
    await sample_groups(model, prompts[:1], samples=2)  # the engine's first requests warm it up, unmeasured
    before = (cpu_seconds(engine), cpu_seconds([trainer]), time.perf_counter())
    groups = await sample_groups(model, prompts, samples=6)
    after = (cpu_seconds(engine), cpu_seconds([trainer]), time.perf_counter())
    sampling_s = after[2] - before[2]
    engine_sampling, trainer_sampling = after[0] - before[0], after[1] - before[1]

    # The second gradient step of a train call is training only: the engine was released before the
    # first one, and the publish comes after the last.
    step = await model.get_step()
    marks = []
    async for _ in model.train_stream(groups, TrainConfig(learning_rate=1e-5, num_gradient_steps=2)):
        marks.append((cpu_seconds(engine[1:]), cpu_seconds([trainer]), time.perf_counter(), idle_seconds()))
    (engine_a, trainer_a, start, idle_a), (engine_b, trainer_b, end, idle_b) = marks[0], marks[1]
    training_s = end - start
    # idle engine: its vLLM processes (the replica actor's own Ray/Serve housekeeping is not the engine)
    engine_training, trainer_training = engine_b - engine_a, trainer_b - trainer_a
    report = (
        f"sampling {sampling_s:.2f} s: engine {engine_sampling:.2f} CPU s, trainer {trainer_sampling:.2f}; "
        f"training {training_s:.2f} s: engine {engine_training:.2f} CPU s, trainer {trainer_training:.2f}, "
        f"idle cores {(idle_b - idle_a) / training_s:.2f}"
    )
    print(report)
    # the idle side sleeps: neither spins nor polls while the other runs
    assert engine_training <= 0.05 * training_s + 0.05, report
    assert trainer_sampling <= 0.05 * sampling_s + 0.05, report
    # the busy side runs on more than one core (2 on the CI box; a one-core side would stay near 1.0)
    if cores >= 2:
        assert trainer_training >= 1.4 * training_s, report
        assert engine_sampling >= 1.2 * sampling_s, report
    # and after the hand-over back, the engine serves the new step
    assert await model.get_step() == step + 1
    served = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step + 1), messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert served.choices[0].message.content is not None
