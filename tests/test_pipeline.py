"""The pipelined loop and the adapter's straight line, on the real stack with the `tiny` model: a RayBackend
of its own ("pipe" at /pipe) in the split layout (engine and trainer on one thread each, overlapping).

- The staleness bound: a group sampled more than `max_steps_off_policy` steps before the policy it would
  train is dropped, never trained (what each step trained is read back from art-ray's Parquet).
- Policy versions come from the served model (the endpoint stamps each choice), for rollouts on the driver
  and as Ray work.
- A stopped run resumes at its step and scenario offset.
- The adapter goes from trainer rank 0 to the object store once, owned by the registry (it outlives the
  trainer); the driver never holds it. The sync loop's `train()` returns once every replica serves the
  new step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from conftest import free_port
from ray import serve

import art_ray
from art_ray import (
    LoRASpec,
    ModelConfig,
    PipelineTrainer,
    RayBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    read_trajectory_groups,
    sampled_tokens,
)
from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry
from art_ray.trainer.group import checkpoint_steps

pytestmark = pytest.mark.slow

CONFIG = ModelConfig(
    lora=LoRASpec(r=8, alpha=16),
    sequence_length=256,
    max_model_len=512,
    layout="split",
    replica_cpus=0,
    trainer_cpus_per_rank=0,
    engine_threads=1,
    trainer_threads=1,
    num_replicas=2,
)
PROMPTS = ["Name a color.", "Say a number.", "Pick an animal.", "Name a city."]


async def rollout(model: TrainableModel, prompt: str) -> Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, temperature=1.0
    )
    choice = completion.choices[0]
    return Trajectory(
        messages_and_choices=[*messages, choice], reward=float(sampled_tokens(choice).token_ids[0] % 2)
    )


remote = art_ray.remote_rollout(rollout)


@pytest.fixture(scope="module")
async def pipe(ray_cluster, tmp_path_factory):  # noqa: ANN201
    storage = tmp_path_factory.mktemp("pipe")
    backend = RayBackend(storage=str(storage), port=free_port(), app_name="pipe", route_prefix="/pipe")
    yield backend, storage
    backend.shutdown()


async def new_model(backend: RayBackend, name: str) -> TrainableModel:
    model = TrainableModel(name=name, project="pipe", base_model="tiny", config=CONFIG)
    await model.register(backend)
    return model


def trained_groups(backend: RayBackend, model: TrainableModel) -> dict[int, list[TrajectoryGroup]]:
    """What each step trained on: {policy the step started from: its groups} (art-ray's train Parquet)."""
    folder = Path(backend.model_dir(model)) / "trajectories" / "train"
    return {int(path.stem): read_trajectory_groups(path) for path in sorted(folder.glob("*.parquet"))}


async def test_stale_groups_are_dropped_and_versions_come_from_the_served_model(pipe) -> None:
    backend, _ = pipe
    model = await new_model(backend, "pipe-stale")
    bound = 1

    async def rollout_group(model: TrainableModel, scenario: tuple[int, str]) -> TrajectoryGroup:
        index, prompt = scenario
        form = remote if index % 2 else rollout  # both rollout forms
        group = await TrajectoryGroup((form(model, prompt) for _ in range(4)), metadata={"scenario": index})
        if index % 3 == 2 and pipeline.state.step >= 2:
            # sampled (so it claims) by step 0: too stale for any step after bound + 1
            for trajectory in group.trajectories:
                trajectory.initial_policy_version = 0
            group.metadata["injected_stale"] = True
        return group

    scenarios = [(i, PROMPTS[i % len(PROMPTS)]) for i in range(400)]
    pipeline = PipelineTrainer(
        model,
        rollout_group,
        scenarios,
        train_config=TrainConfig(learning_rate=1e-3),
        num_rollout_workers=3,
        min_batch_size=2,
        max_batch_size=3,
        max_steps_off_policy=bound,
        max_steps=4,
        resume=False,
    )
    reports = await pipeline.train()
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert pipeline.state.groups_stale >= 1  # the injected ones at least
    trained = trained_groups(backend, model)
    assert sorted(trained) == [0, 1, 2, 3]
    for policy, groups in trained.items():
        for group in groups:
            assert not group.metadata.get("injected_stale"), f"a stale group was trained at step {policy + 1}"
            for trajectory in group.trajectories:
                assert policy - trajectory.initial_policy_version <= bound
                assert trajectory.initial_policy_version <= trajectory.final_policy_version <= policy
                choice = trajectory.messages_and_choices[-1]
                # stamped from the step the endpoint served, not from the loop's counter
                assert choice.model_extra["policy_version"] == trajectory.initial_policy_version
    assert max(r.steps_off_policy_max for r in reports) <= bound


async def test_a_stopped_run_resumes_at_its_step_and_scenario_offset(pipe) -> None:
    backend, _ = pipe
    model = await new_model(backend, "pipe-resume")
    seen: list[int] = []

    async def rollout_group(model: TrainableModel, index: int) -> TrajectoryGroup:
        seen.append(index)
        return await TrajectoryGroup(rollout(model, PROMPTS[index % len(PROMPTS)]) for _ in range(4))

    def pipeline(max_steps: int) -> PipelineTrainer:
        return PipelineTrainer(
            model,
            rollout_group,
            range(1000),
            num_rollout_workers=2,
            min_batch_size=2,
            max_steps=max_steps,
            max_steps_off_policy=1,
        )

    first = pipeline(2)
    await first.train()
    offset = first.state.scenario_offset
    assert first.state.step == 2 and offset >= 4 and len(seen) == offset
    seen.clear()
    second = pipeline(1)
    reports = await second.train()
    assert [r.step for r in reports] == [3]
    assert min(seen) == offset  # the scenarios the first run took are not taken again


async def test_the_adapter_never_passes_through_the_driver_and_sync_train_waits_for_replicas(pipe) -> None:
    backend, storage = pipe
    model = await new_model(backend, "pipe-line")
    groups = [await TrajectoryGroup(rollout(model, prompt) for _ in range(4)) for prompt in PROMPTS[:2]]
    groups = [g for g in groups if len(set(g.rewards)) > 1] or groups
    step = await model.train(groups, TrainConfig(learning_rate=1e-3))
    # on return every replica serves the new step (the sync loop's guarantee)
    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, backend.app_name)
    served = await handle.broadcast("served_models").results_async(timeout_s=60)
    assert len(served) == CONFIG.num_replicas and all(step in models[model.name] for models in served)
    # the driver holds no reference to the published tensors: rank 0 made them, the registry owns them
    held = set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())  # hex ids
    registry = get_registry()
    version = await registry.get.remote(model.name, step)
    assert version.tensors.hex().encode() not in held
    # (the check can see a reference: the driver holds this one now that it asked the registry)
    assert (
        version.tensors.hex().encode()
        in ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    )
    from ray.core.generated.common_pb2 import Address

    owner = Address.FromString(version.tensors.owner_address()).worker_id.hex()
    assert owner == await registry.__ray_call__.remote(lambda self: ray.get_runtime_context().get_worker_id())
    # so the version outlives its trainer: a replica that starts later still loads it
    backend._trainers.pop(model.name).shutdown()
    packed = await version.tensors
    assert packed.nbytes > 0
    assert model.last_train_result.metrics["time/publish_enqueue_seconds"] < 5


def test_a_checkpoint_without_its_completion_mark_is_never_resumed_from(tmp_path) -> None:
    from art_ray.trainer.config import TrainerConfig
    from art_ray.trainer.worker import STATE_FILE

    config = TrainerConfig(model="m", project="p", base_model="tiny", storage=str(tmp_path))
    for step in (1, 2):
        folder = Path(config.checkpoint_dir(step))
        (folder / "deepspeed").mkdir(parents=True)
        if step == 1:
            (folder / STATE_FILE).write_text('{"step": 1}')
    # step 2's write was interrupted: its folder exists, its completion mark does not
    assert checkpoint_steps(config) == [1]
