"""The driver SDK on the real stack with the `tiny` model: RayBackend, TrainableModel's verbs, rollouts
on the driver and as Ray work, MLflow and Parquet, and a restart that resumes.

The backend runs its own Serve app ("sdk" at /sdk) next to the session's app, as a user's backend
would on a shared cluster. The tests run in file order: the last one restarts the backend.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import free_port
from factories import TINY_CONFIG

from art_ray import (
    LoRASpec,
    OnlineTrainConfig,
    OnlineTrainer,
    RayBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    captured_rollout,
    gather_trajectory_groups,
    read_trajectory_groups,
    remote_rollout,
    sampled_tokens,
)
from art_ray.adapters.lora_files import initial_adapter, read_peft_adapter
from art_ray.adapters.registry import publish_adapter
from art_ray.errors import BackendError
from art_ray.models import resolve_base_model
from art_ray.traffic.files import read_traffic
from art_ray.trainer.worker import STATE_FILE

pytestmark = pytest.mark.slow

API_KEY = "sdk-key"
PROMPTS = ["Name a color.", "Say a number.", "Pick an animal."]
CONFIG = TINY_CONFIG


async def rollout(model: TrainableModel, prompt: str) -> Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0
    )
    choice = completion.choices[0]
    # any reward with variance inside a group exercises the mechanics
    reward = float(sampled_tokens(choice).token_ids[0] % 2)
    return Trajectory(messages_and_choices=[*messages, choice], reward=reward, metadata={"pid": os.getpid()})


def new_model() -> TrainableModel:
    return TrainableModel(name="sdk-model", project="sdk-tests", base_model="tiny", config=CONFIG)


def new_backend(storage: Path) -> RayBackend:
    return RayBackend(
        storage=str(storage), port=free_port(), api_key=API_KEY, app_name="sdk", route_prefix="/sdk"
    )


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sdk")


@pytest.fixture(scope="module")
async def registered(ray_cluster, storage):
    backend = new_backend(storage)
    model = new_model()
    await model.register(backend)
    yield backend, model
    backend.shutdown()


async def sampled_groups(model: TrainableModel) -> list[TrajectoryGroup]:
    return await gather_trajectory_groups(
        (TrajectoryGroup(rollout(model, prompt) for _ in range(6)) for prompt in PROMPTS), pbar_desc=None
    )


def served_names(model: TrainableModel) -> set[str]:
    client = openai.OpenAI(base_url=model.base_url, api_key=model.api_key, max_retries=0)
    return {entry.id for entry in client.models.list().data}


async def test_train_log_track_and_save(registered, storage):
    backend, model = registered
    assert model.base_url.endswith("/sdk/v1")
    assert await model.get_step() == 0
    groups = await sampled_groups(model)
    assert [len(g) for g in groups] == [6, 6, 6]
    assert any(len(set(g.rewards)) > 1 for g in groups)
    val = await gather_trajectory_groups(
        [TrajectoryGroup(rollout(model, p) for p in PROMPTS)], pbar_desc=None
    )
    val_metrics = await model.log(val, split="val")
    assert val_metrics["val/reward"] == pytest.approx(sum(val[0].rewards) / 3)

    assert await model.train(groups, TrainConfig(learning_rate=1e-3), verbose=False) == 1
    assert await model.get_step() == 1
    assert "sdk-model@1" in served_names(model)
    assert model.last_train_metrics and "loss/train" in model.last_train_metrics[0]

    # MLflow: train reward at the step it was sampled from, losses at the step they produced
    assert model.tracker.history("train/reward") == {
        0: pytest.approx(sum(sum(g.rewards) for g in groups) / 18)
    }
    assert set(model.tracker.history("loss/train")) == {1}
    assert set(model.tracker.history("val/reward")) == {0}
    # Parquet: what was logged comes back
    model_dir = Path(backend.model_dir(model))
    saved = read_trajectory_groups(str(model_dir / "trajectories" / "train" / "0000.parquet"))
    assert [g.rewards for g in saved] == [g.rewards for g in groups]
    assert (
        sampled_tokens(saved[0].trajectories[0].messages_and_choices[-1]).token_ids
        == sampled_tokens(groups[0].trajectories[0].messages_and_choices[-1]).token_ids
    )
    saved_val = read_trajectory_groups(str(model_dir / "trajectories" / "val" / "0000.parquet"))
    assert saved_val[0].rewards == val[0].rewards


async def test_a_second_model_of_the_same_name_and_another_config_is_refused(registered):
    backend, model = registered
    other_rank = CONFIG.model_copy(update={"lora": LoRASpec(r=4, alpha=8)})
    other = TrainableModel(name=model.name, project="sdk-tests", base_model="tiny", config=other_rank)
    with pytest.raises(BackendError, match="already registered"):
        await other.register(backend)
    await new_model().register(backend)  # the same model again: nothing new starts
    assert backend._trainers[model.name].config.settings.lora.r == CONFIG.lora.r


async def test_remote_rollouts_run_as_ray_work(registered):
    _, model = registered
    remote = remote_rollout(rollout)
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(remote(model, prompt) for _ in range(3)) for prompt in PROMPTS), pbar_desc=None
    )
    pids = {t.metadata["pid"] for g in groups for t in g}
    assert [len(g) for g in groups] == [3, 3, 3]
    assert os.getpid() not in pids  # ran in the runner actors, not on the driver
    assert all(sampled_tokens(t.messages_and_choices[-1]).token_ids for g in groups for t in g)


async def test_a_remote_rollout_whose_worker_dies_is_retried(registered, tmp_path):
    _, model = registered
    marker = tmp_path / "died-once"

    def dies_once(model: TrainableModel, prompt: str, marker: str) -> Trajectory:  # a sync rollout
        import os
        import pathlib

        import openai

        if not pathlib.Path(marker).exists():
            pathlib.Path(marker).touch()
            os._exit(1)  # the worker process is gone mid-rollout, as when a node is lost
        client = openai.OpenAI(base_url=model.base_url, api_key=model.api_key)
        messages = [{"role": "user", "content": prompt}]
        choice = client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4
        ).choices[0]
        return Trajectory(messages_and_choices=[*messages, choice], reward=1.0)

    remote = remote_rollout(dies_once, max_retries=2, num_runners=1)
    trajectory = await remote(model, PROMPTS[0], str(marker))
    assert marker.exists()
    assert trajectory.reward == 1.0 and sampled_tokens(trajectory.messages_and_choices[-1]).token_ids


async def test_a_remote_rollouts_own_exception_is_not_retried(registered, tmp_path):
    _, model = registered
    calls = tmp_path / "calls"
    calls.mkdir()

    async def fails(prompt: str, calls: str) -> Trajectory:
        import pathlib
        import uuid

        (pathlib.Path(calls) / uuid.uuid4().hex).touch()
        raise ValueError(f"bad prompt {prompt!r}")

    remote = remote_rollout(fails)
    groups = await gather_trajectory_groups(
        [TrajectoryGroup([remote("x", str(calls)), rollout(model, PROMPTS[0])])],
        max_exceptions=1,
        pbar_desc=None,
    )
    assert len(groups[0]) == 1 and len(groups[0].exceptions) == 1
    assert "bad prompt 'x'" in groups[0].exceptions[0].message
    assert len(list(calls.iterdir())) == 1


async def test_a_killed_trainer_rank_is_restarted_and_its_step_ends_as_if_nothing_happened(registered):
    """Two models train on the same groups on one shared trainer; it loses rank 0 before their second
    step, while the first model's first checkpoint was not yet complete: its train() call still returns the
    step (step 1 trained again from the same groups), the other run is restarted on the new ranks with it.
    At the third step rank 0 dies after the first model's call made its step, as it waits for step 2's
    checkpoint: steps 2 and 3 are on no storage; the call returns step 3, step 2 made again from the last
    call's groups and step 3 from its own (the soak found the previous call's groups trained again and the
    call's step made twice; later, both steps lost). Their adapters are equal, and MLflow holds each row
    once."""
    import mlflow
    import torch
    from conftest import stop_trainer

    backend, sampler = registered
    # their own trainer (another micro-batch size than the session model's), shared by the two
    shared = CONFIG.model_copy(update={"share_trainer": True, "micro_batch_rows": 2})
    killed, reference = (
        TrainableModel(name=name, project="sdk-tests", base_model="tiny", config=shared)
        for name in ("sdk-killed", "sdk-reference")
    )
    for model in (killed, reference):
        await model.register(backend)
    ranks = backend._trainers[killed.name].ranks
    assert backend._trainers[reference.name].ranks is ranks and ranks.runs == {killed.name, reference.name}
    try:
        for step in (1, 2, 3):
            groups = await gather_trajectory_groups(
                (TrajectoryGroup(rollout(sampler, prompt) for _ in range(4)) for prompt in PROMPTS),
                pbar_desc=None,
            )
            trainer = backend._trainers[killed.name]
            if step == 2:  # rank 0 is gone, as on a lost node, before step 1's checkpoint was complete
                await trainer.wait_for_checkpoint()
                (Path(trainer.config.checkpoint_dir(1)) / STATE_FILE).unlink()
                await kill_rank(trainer.workers[0])
            if step == 3:
                die_while_step_2_is_written(trainer)
            for model in (killed, reference):
                assert await model.train(groups, TrainConfig(learning_rate=1e-3), verbose=False) == step
            if step == 2:
                restarted = backend._trainers[killed.name].ranks
                assert restarted is not ranks and backend._trainers[reference.name].ranks is restarted
        assert backend._trainers[killed.name].ranks is not restarted
        assert await reference.get_step() == 3
        adapters = [await backend._trainers[m.name].adapter_tensors() for m in (killed, reference)]
        assert adapters[0].keys() == adapters[1].keys()
        for name, tensor in adapters[0].items():
            torch.testing.assert_close(tensor, adapters[1][name], rtol=0, atol=1e-6, msg=name)
        assert f"{killed.name}@3" in served_names(killed)
        client = mlflow.MlflowClient(killed.tracker.tracking_uri)
        for metric in ("train/reward", "loss/train"):
            rows = client.get_metric_history(killed.tracker.run_id, metric)
            assert sorted(row.step for row in rows) == ([0, 1, 2] if metric == "train/reward" else [1, 2, 3])
    finally:
        for model in (killed, reference):
            stop_trainer(backend, model.name)


async def kill_rank(worker) -> None:  # noqa: ANN001
    """A trainer rank killed as a lost node kills it, gone when this returns: `ray.kill` returns before
    the actor dies, and a call sent meanwhile may still be answered (a full run of the suite saw a step's
    checkpoint started on a rank being killed, so the run's last complete checkpoint was pruned and the
    restart found none)."""
    import ray

    ray.kill(worker)
    while True:
        try:
            await worker.__ray_ready__.remote()
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.05)


def die_while_step_2_is_written(trainer) -> None:  # noqa: ANN001
    """The group's rank 0 dies after its next call made step 3, as that call waits for step 2's
    checkpoint to be complete (made here incomplete): no storage holds steps 2 and 3."""
    wait = trainer.wait_for_checkpoint

    async def waiting_on_a_dying_rank() -> None:
        trainer.wait_for_checkpoint = wait
        await wait()
        (Path(trainer.config.checkpoint_dir(2)) / STATE_FILE).unlink()
        await kill_rank(trainer.workers[0])
        await trainer.workers[0].get_step.remote(trainer.run)  # the call meets its dead rank

    trainer.wait_for_checkpoint = waiting_on_a_dying_rank


async def test_a_tinker_run_keeps_its_steps_and_waiting_gradients_when_a_trainer_rank_dies(registered):
    """Two Tinker runs share a trainer; it loses rank 0 after both runs' forward_backward calls of step 2,
    before their optim_step, while the first run's step-1 checkpoint was not yet complete. Each optim_step
    still returns step 2: step 1 is made again from its calls, the calls waiting for step 2 are sent to the
    new ranks. At step 3 rank 0 dies after the first run's optim_step made it, as it waits for step 2's
    checkpoint: that call still returns step 3, steps 2 and 3 made again from their calls, and the
    sibling's waiting calls go to the new ranks. Both adapters equal a third run's on its own ranks that no
    fault touched, and the killed run keeps only the step checkpoints a restart needs."""
    from conftest import stop_trainer
    from test_tinker_trainer import CONVERSATIONS, tinker_data
    from transformers import AutoTokenizer

    from art_ray.tinker.types import AdamStep, ForwardBackwardCall

    backend, _ = registered
    data = tinker_data(AutoTokenizer.from_pretrained(resolve_base_model("tiny")), CONVERSATIONS)
    adam = AdamStep(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-8)
    shared = CONFIG.model_copy(update={"share_trainer": True, "micro_batch_rows": 2})
    killed, sibling, untouched = (
        TrainableModel(name=name, project="sdk-tests", base_model="tiny", config=config)
        for name, config in (
            ("tinker-killed", shared),
            ("tinker-sibling", shared),
            ("tinker-untouched", shared.model_copy(update={"share_trainer": False})),
        )
    )
    models = (killed, sibling, untouched)
    for model in models:
        await model.register(backend)
    ranks = backend._trainers[killed.name].ranks
    assert backend._trainers[sibling.name].ranks is ranks
    assert backend._trainers[untouched.name].ranks is not ranks
    try:
        for step in (1, 2, 3):
            for model in models:
                await backend.forward_backward(
                    model, ForwardBackwardCall(data=data[:1], loss_fn="cross_entropy")
                )
                await backend.forward_backward(
                    model, ForwardBackwardCall(data=data[1:], loss_fn="cross_entropy")
                )
            if step == 2:  # rank 0 is gone, as on a lost node, before step 1's checkpoint was complete
                trainer = backend._trainers[killed.name]
                await trainer.wait_for_checkpoint()
                (Path(trainer.config.checkpoint_dir(1)) / STATE_FILE).unlink()
                await kill_rank(trainer.workers[0])
            if step == 3:
                restarted = backend._trainers[killed.name]
                die_while_step_2_is_written(restarted)
            for model in models:
                await backend.optim_step(model, adam)
                assert await backend.get_step(model) == step
        assert backend._trainers[killed.name].ranks not in (ranks, restarted.ranks)
        assert backend._trainers[sibling.name].ranks is backend._trainers[killed.name].ranks
        # each optim_step keeps the last complete step checkpoint and its own (step 1's is gone)
        await backend._trainers[killed.name].wait_for_checkpoint()
        assert backend.checkpoint_steps(killed) == [2, 3]
        adapters = [await backend._trainers[m.name].adapter_tensors() for m in models]
        assert any(tensor.abs().sum() > 0 for name, tensor in adapters[2].items() if "lora_B" in name)
        for adapter in adapters[:2]:
            assert adapter.keys() == adapters[2].keys()
            for name, tensor in adapter.items():
                torch.testing.assert_close(tensor, adapters[2][name], rtol=0, atol=1e-6, msg=name)
    finally:
        for model in models:
            stop_trainer(backend, model.name)


async def langchain_agent(session, prompt: str) -> float:  # noqa: ANN001
    """An agent that knows nothing of token ids or art-ray: only the base URL it is given."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=session.model, base_url=session.base_url, api_key=session.api_key, max_tokens=6)
    reply = await llm.ainvoke(prompt)
    return float(len(reply.content) % 2)


async def responses_agent(session, prompt: str) -> float:  # noqa: ANN001
    """The same, speaking the Responses API through the OpenAI SDK."""
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    reply = await client.responses.create(model=session.model, input=prompt, max_output_tokens=6)
    return float(len(reply.output_text) % 2)


async def anthropic_agent(session, prompt: str) -> float:  # noqa: ANN001
    """The same, speaking Anthropic Messages through the anthropic SDK."""
    import anthropic

    client = anthropic.AsyncAnthropic(
        base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
    )
    reply = await client.messages.create(
        model=session.model, messages=[{"role": "user", "content": prompt}], max_tokens=6
    )
    return float(len("".join(block.text for block in reply.content if block.type == "text")) % 2)


async def agents_sdk_agent(session, prompt: str) -> float:  # noqa: ANN001
    """The same, an OpenAI Agents SDK agent on its default model, which speaks the Responses API."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=session.model, openai_client=session.openai_client(max_retries=0))
    agent = Agent(name="assistant", model=model, model_settings=ModelSettings(max_tokens=6))
    result = await Runner.run(agent, prompt, max_turns=1)
    return float(len(result.final_output) % 2)


# each prompt's group comes from one client
AGENTS = dict(
    zip(
        [*PROMPTS, "Name a fruit."],
        (langchain_agent, responses_agent, anthropic_agent, agents_sdk_agent),
        strict=True,
    )
)


async def protocol_agent(session, prompt: str) -> float:  # noqa: ANN001
    return await AGENTS[prompt](session, prompt)


async def test_captured_runs_of_every_protocol_train_a_step_that_changes_the_served_model(registered):
    """Runs of agents that speak chat completions (LangChain), the Responses API (the openai SDK, the
    Agents SDK's default model) and Anthropic Messages, as remote rollouts in capture sessions, become
    trajectories; their groups train one step, the new step's outputs differ from the old one's, and each
    protocol's next reply comes from the new step. The model trains on the first model's trainer
    (`share_trainer`)."""
    import anthropic

    backend, first = registered
    # it trains on the first model's trainer: one copy of the base weights, no second trainer to start
    shared = CONFIG.model_copy(update={"share_trainer": True})
    model = TrainableModel(name="sdk-captured", project="sdk-tests", base_model="tiny", config=shared)
    await model.register(backend)
    assert backend._trainers[model.name].ranks is backend._trainers[first.name].ranks
    first_step = await first.get_step()
    agent = captured_rollout(protocol_agent)

    async def greedy_logprobs(step: int) -> list[float]:
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(step),
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=4,
            temperature=0,
        )
        return sampled_tokens(completion.choices[0]).logprobs

    try:
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(agent(model, prompt) for _ in range(6)) for prompt in AGENTS), pbar_desc=None
        )
        for group in groups:
            for trajectory in group:
                (choice,) = trajectory.trainable_choices()
                assert trajectory.reward == len(choice.message.content or "") % 2
        assert await model.train(groups, TrainConfig(learning_rate=1e-3), verbose=False) == 1
        assert await greedy_logprobs(1) != await greedy_logprobs(0)
        latest = f"{model.name}@1"
        response = await model.openai_client().responses.create(
            model=model.name, input="hi", max_output_tokens=2
        )
        claude = anthropic.AsyncAnthropic(
            base_url=model.base_url.removesuffix("/v1"), api_key=model.api_key, max_retries=0
        )
        message = await claude.messages.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert response.model == message.model == latest
        assert await first.get_step() == first_step  # the run it shares a trainer with did not move
    finally:
        await backend.delete_run(model, purge_checkpoints=True)
    # deleted: its names are unknown, its checkpoints gone; the run it shared a trainer with goes on
    assert backend._trainers[first.name].ranks.runs == {first.name}
    names = served_names(first)
    assert (
        not any(name.startswith(f"{model.name}@") for name in names) and f"{first.name}@{first_step}" in names
    )
    with pytest.raises(openai.NotFoundError):
        await model.openai_client().chat.completions.create(
            model=f"{model.name}@1", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert not Path(backend.storage, "sdk-tests", "models", model.name, "checkpoints").exists()


async def test_an_idle_run_is_deleted_after_its_time_to_live(registered):
    """ModelConfig.idle_ttl_s: calls keep a run alive; once none came for that long, it is deleted (its
    names answer 404) and the run it shared a trainer with goes on."""
    backend, first = registered
    config = CONFIG.model_copy(update={"share_trainer": True, "idle_ttl_s": 2.0})
    model = TrainableModel(name="sdk-idle", project="sdk-tests", base_model="tiny", config=config)
    await model.register(backend)

    def still_served() -> bool:
        return any(name.split("@")[0] == model.name for name in served_names(first))

    assert await asyncio.to_thread(still_served)
    for _ in range(4):  # 4 s of calls a second apart: past its time-to-live, but never idle that long
        await asyncio.sleep(1.0)
        assert await model.get_step() == 0

    # the reaper deletes in the background: the run stops being registered at once, and its names stop
    # being served once its last checkpoint is written and every replica has unloaded them
    deadline = time.monotonic() + 30
    while (backend.is_registered(model.name) or await asyncio.to_thread(still_served)) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.25)
    assert not backend.is_registered(model.name)
    with pytest.raises(openai.NotFoundError):
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert backend._trainers[first.name].ranks.runs == {first.name}
    assert f"{first.name}@{await first.get_step()}" in served_names(first)


def val_group(reward: float) -> TrajectoryGroup:
    return TrajectoryGroup(
        [Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=reward)]
    )


async def test_a_run_stores_its_traffic_and_the_feedback_on_it(registered, storage):
    """ModelConfig.traffic: every protocol's completions of the run are stored with their completion id,
    token data, sampling parameters and policy version, except `store: false` ones and other runs'.
    Feedback joins them by id (idempotent), by a key that sees the run or the response's signed token;
    the rest is refused in the endpoint's error shape. A restarted log loses nothing."""
    import httpx
    import ray

    from art_ray import FeedbackError, KeyGrant, TrafficConfig
    from art_ray.traffic.log import get_traffic_log

    backend, untracked = registered
    # its owner's key never stores (a tenant that did not consent); the admin key's requests are stored
    quiet = await backend.create_key(KeyGrant(name="sdk-quiet", store_traffic=False))
    config = CONFIG.model_copy(
        update={"share_trainer": True, "traffic": TrafficConfig(flush_turns=4), "owner": "sdk-quiet"}
    )
    model = TrainableModel(name="sdk-traffic", project="sdk-tests", base_model="tiny", config=config)
    await model.register(backend)
    client = model.openai_client()
    hello = [{"role": "user", "content": "Say hello."}]

    raw = await client.chat.completions.with_raw_response.create(
        model=model.name, messages=hello, max_tokens=4, temperature=0.7
    )
    chat, token = raw.parse(), raw.headers["x-art-ray-feedback-token"]
    stream = await client.chat.completions.create(model=model.name, messages=hello, max_tokens=4, stream=True)
    streamed = {chunk.id async for chunk in stream}
    text = await client.completions.create(model=f"{model.name}@0", prompt="Count:", max_tokens=3)
    answered = await client.responses.create(model=model.name, input="Hi", max_output_tokens=4)
    tagged = await client.chat.completions.create(
        model=model.name, messages=hello, max_tokens=2, metadata={"task": "greet"}
    )
    with pytest.raises(openai.BadRequestError, match="metadata"):
        await client.chat.completions.create(
            model=model.name, messages=hello, max_tokens=2, extra_body={"metadata": {"task": 1}}
        )
    # not stored: the request opts out, or the run stores no traffic
    opted_out = await client.chat.completions.create(
        model=model.name, messages=hello, max_tokens=2, extra_body={"store": False}
    )
    await client.responses.create(model=model.name, input="Hi", max_output_tokens=2, store=False)
    other = await untracked.openai_client().chat.completions.create(
        model=untracked.name, messages=hello, max_tokens=2
    )
    unconsented = await openai.AsyncOpenAI(base_url=model.base_url, api_key=quiet).chat.completions.create(
        model=model.name, messages=hello, max_tokens=2
    )

    snapshot = await model.traffic()
    turns = {turn.completion_id: turn.turn for turn in snapshot.turns}
    assert len(turns) == 5 and {chat.id, text.id, tagged.id, *streamed} <= set(turns)
    assert turns[tagged.id].metadata == {"task": "greet"} and turns[chat.id].metadata is None
    assert answered.id.removeprefix("resp_") in {cid.removeprefix("chatcmpl-") for cid in turns}
    assert turns[chat.id].choice["sampling_params"]["temperature"] == 0.7
    assert turns[chat.id].choice["token_ids"] == sampled_tokens(chat.choices[0]).token_ids
    assert {turn.choice["policy_version"] for turn in turns.values()} == {0}
    assert opted_out.id not in turns and other.id not in turns and unconsented.id not in turns

    record = await model.feedback(chat.id, score=1.0, comment="good", feedback_id="fb-sdk-test-000001")
    again = await model.feedback(chat.id, score=-1.0, feedback_id="fb-sdk-test-000001")
    assert again == record and (record.completion_id, record.score, record.source) == (chat.id, 1.0, "user")
    for missing in (opted_out.id, other.id, "chatcmpl-unknown"):
        with pytest.raises(FeedbackError) as refused:
            await model.feedback(missing, score=0.0)
        assert refused.value.status == 404
    with pytest.raises(ValueError):
        await model.feedback(chat.id, score=float("inf"))

    async with httpx.AsyncClient(base_url=model.base_url) as browser:  # no API key: the token alone
        posted = await browser.post("/feedback", json={"token": token, "score": 0.5, "source": "user"})
        assert posted.status_code == 200 and posted.json()["completion_id"] == chat.id
        forged = await browser.post("/feedback", json={"token": token[:-4] + "0000", "score": 0.5})
        assert forged.status_code == 401 and forged.json()["error"]["type"] == "AuthenticationError"
        keyless = await browser.post("/feedback", json={"completion_id": chat.id, "score": 0.5})
        assert keyless.status_code == 401
        malformed = await browser.post(
            "/feedback",
            json={"completion_id": chat.id, "score": "high"},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "score"
        outsider = await backend.create_key(KeyGrant(name="sdk-outsider"))
        foreign = await browser.post(
            "/feedback",
            json={"completion_id": chat.id, "score": 0.5},
            headers={"Authorization": f"Bearer {outsider}"},
        )
        assert foreign.status_code == 404  # another key's run: as if the turn did not exist

    log = get_traffic_log(model.name)
    ray.kill(log, no_restart=False)  # Ray restarts it; it reads its files and its segment back
    restored = await model.traffic()
    assert {turn.completion_id for turn in restored.turns} == set(turns)
    assert sorted(f.score for f in restored.feedback) == [0.5, 1.0]
    assert (await model.feedback(text.id, score=0.0)).completion_id == text.id
    by_response_id = await model.feedback(answered.id, score=0.25)  # resp_X: served as chatcmpl-X
    assert by_response_id.completion_id in turns

    # the labeled turns train the run (art_ray/traffic/online.py): chat (0.75, the mean of its two
    # scores), text (0.0) and the Responses turn (0.25) are one task (no system prompt, no tools),
    # compared with each other
    trainer = OnlineTrainer(model, OnlineTrainConfig(min_turns=2))
    report = await trainer.step()
    assert report is not None and report.trained and (report.step, report.turns, report.groups) == (1, 3, 1)
    assert report.reward == pytest.approx(1 / 3) and report.coverage == 1.0  # nothing past the window
    assert await model.get_step() == 1 and await trainer.step() is None  # each turn trains once
    logged = read_trajectory_groups(
        f"{storage}/sdk-tests/models/sdk-traffic/trajectories/traffic/0001.parquet"
    )
    trained = {t.metadata["completion_id"] for g in logged for t in g.trajectories}
    assert trained == {chat.id, text.id, by_response_id.completion_id}
    await backend.delete_run(model)
    assert read_traffic(f"{storage}/sdk-tests/models/sdk-traffic/traffic").turns  # the files stay


async def test_a_release_serves_a_new_step_to_a_sticky_share_and_rolls_it_back(registered, capsys):
    """ModelConfig.release: a trained step is not `name` until released; a canary gives it to a sticky
    share of users (by `user`), the arms' feedback rolls it back in one registry push (every user on the
    stable step, `name@step` still pinned); by hand a later step is paused, resumed and promoted; `art-ray
    status` and `art-ray release` show it."""
    from art_ray import ReleaseError, ReleasePolicy, TrafficConfig
    from art_ray.cli import main as art_ray_cli
    from art_ray.status import cluster_status

    backend, _ = registered
    policy = ReleasePolicy(stages=[0.5, 1.0], holdout=0.0, min_feedback=5)
    config = CONFIG.model_copy(update={"share_trainer": True, "traffic": TrafficConfig(), "release": policy})
    model = TrainableModel(name="sdk-release", project="sdk-tests", base_model="tiny", config=config)
    await model.register(backend)
    client = model.openai_client()
    hello = [{"role": "user", "content": "Say hello."}]

    async def served(user: str, name: str = model.name) -> tuple[int, str]:
        reply = await client.chat.completions.create(model=name, messages=hello, max_tokens=2, user=user)
        return reply.choices[0].model_extra["policy_version"], reply.id

    assert (await model.release()).release.stable == 0  # type: ignore[union-attr]
    await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-3), verbose=False)
    assert {(await served(f"early-{i}"))[0] for i in range(6)} == {0}  # trained, not released

    started = (await model.release("start")).release
    assert started is not None and (started.candidate, started.share, started.status) == (1, 0.5, "canary")
    users = [f"user-{i}" for i in range(60)]
    arms = {user: started.arm_for(user, 0.0) for user in users}
    for user in users:  # the candidate's users are unhappy, the stable step's happy
        version, completion_id = await served(user)
        assert version == arms[user] and (await served(user))[0] == version  # sticky
        await model.feedback(completion_id, score=0.0 if version == 1 else 1.0)
    # step 2 trains on step 1's weights while step 1 is the canary
    await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-3), verbose=False)
    checked = await model.release("check")
    assert checked.decision is not None and checked.decision.action == "rollback", checked.decision
    assert checked.arms[1].score.mean == 0.0 and checked.arms[0].score.mean == 1.0
    assert checked.release is not None and checked.release.rejected == (1, 2)  # step 1 and what grew on it
    assert {(await served(user))[0] for user in users[:12]} == {0}  # every replica, at once
    assert (await served("pinned", f"{model.name}@1"))[0] == 1
    with pytest.raises(ReleaseError, match="rolled back"):
        await model.release("start", 2)

    # the trainer went back to step 0's weights and optimizer state: a step that barely moves equals it
    await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-12), verbose=False)
    assert (await model.release("start", 3)).release.candidate == 3  # type: ignore[union-attr]
    await model.release("pause")
    assert {(await served(user))[0] for user in users[:12]} == {0}
    await model.release("resume")
    await asyncio.to_thread(art_ray_cli, ["release", model.name, "promote", "--reason", "looks good"])
    printed = capsys.readouterr().out
    assert "promoted, stable step 3" in printed and "last move: looks good" in printed
    assert {(await served(user))[0] for user in users[:12]} == {3}
    status = await asyncio.to_thread(cluster_status)
    release = next(m.release for m in status.models if m.model == model.name)
    assert release is not None and (release.stable, release.rejected) == (3, (1, 2))
    checkpoints = Path(backend.model_dir(model)) / "checkpoints"
    await backend.delete_run(model)  # after its last checkpoint is written
    adapters = {step: read_peft_adapter(checkpoints / f"{step:04d}" / "adapter") for step in (0, 1, 3)}
    for name, weight in adapters[0].items():
        assert torch.allclose(adapters[3][name], weight, atol=1e-6), name
    assert any(not torch.equal(adapters[1][name], weight) for name, weight in adapters[0].items())


async def test_restart_resumes_step_and_run_then_delete_checkpoints(registered, storage):
    backend, model = registered
    import mlflow

    if await model.get_step() == 0:  # run alone, without the tests above that train the module's model
        await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-3), verbose=False)
    run_id = model.tracker.run_id
    runs = mlflow.MlflowClient(model.tracker.tracking_uri)
    backend.shutdown()  # as if the driver script stopped
    assert runs.get_run(run_id).info.status == "FINISHED"

    backend = new_backend(storage)
    model = new_model()
    try:
        await model.register(backend)
        assert await model.get_step() == 1
        assert model.tracker.run_id == run_id
        assert runs.get_run(run_id).info.status == "RUNNING"
        assert {"sdk-model", "sdk-model@1"} <= served_names(model)

        # val/reward by step: 0.9 at step 1 (the best checkpoint), 0.2 at 2, 0.5 at 3 (the latest)
        for reward in (0.9, 0.2):
            await model.log([val_group(reward)], split="val")
            await model.train(await sampled_groups(model), TrainConfig(learning_rate=1e-3), verbose=False)
        await model.log([val_group(0.5)], split="val")
        assert backend.checkpoint_steps(model) == [1, 2, 3]
        assert sorted(await model.delete_checkpoints("val/reward")) == [2]
        assert backend.checkpoint_steps(model) == [1, 3]
    finally:
        backend.shutdown()
    assert runs.get_run(run_id).info.status == "FINISHED"
    # the deleted app no longer takes part in publishing (other apps on the cluster keep training)
    spec = LoRASpec(r=8, alpha=16)
    base_model = resolve_base_model("tiny")
    assert await publish_adapter("after-sdk", 0, base_model, spec, initial_adapter(base_model, spec)) >= 0
