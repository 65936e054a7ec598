"""Remote training over HTTP: a driver with an HTTPBackend (no Ray of its own in the calls) registers a
`tiny` model with the training server app on the session cluster, samples from the endpoint the server
names, trains through the NDJSON stream, logs, reads the step and deletes checkpoints; bad requests get
OpenAI-style error JSON and change nothing.

The server runs as a Serve app ("art-train" at /_art) beside the session's apps, with its own inference
app ("http" at /http). Tests run in file order on one registered model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import free_port
from factories import TINY_CONFIG, cookbook_environment
from openai.types.chat.chat_completion import Choice

from art_ray import (
    GradientStep,
    HTTPBackend,
    RemoteTrainingError,
    SFTConfig,
    TrainableModel,
    TrainConfig,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
    read_trajectory_groups,
    sampled_tokens,
)
from art_ray.cli import main as cli_main
from art_ray.models import resolve_base_model
from art_ray.remote.protocol import ModelSpec
from art_ray.remote.server import (
    APP_NAME,
    AuthRequiredError,
    TrainingServerConfig,
    is_loopback,
    require_auth_off_localhost,
    start_training_server,
)
from art_ray.status import cluster_status, format_status
from art_ray.tinker.config import TinkerConfig

pytestmark = pytest.mark.slow

API_KEY = "http-key"
CONFIG = TINY_CONFIG
PROMPTS = ["Name a color.", "Say a number."]
NO_LOGPROBS = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "y"}}


@pytest.fixture(scope="module")
def server_url(ray_cluster, tmp_path_factory) -> Iterator[str]:
    config = TrainingServerConfig(
        storage=str(tmp_path_factory.mktemp("http")),
        api_key=API_KEY,
        inference_app_name="http",
        inference_route_prefix="/http",
        # tinker-cookbook's recipes name the base model by the folder their tokenizer loads from offline
        tinker=TinkerConfig(
            base_models=["tiny", resolve_base_model("tiny")],
            run_config=CONFIG.model_copy(update={"share_trainer": True}),
        ),
    )
    yield start_training_server(config, port=free_port())
    # Its inference app serves the same base model as the session's app: left up, it would also load
    # (and be counted for) every version published later in the session.
    from ray import serve

    from art_ray.serving.launch import stop_inference

    serve.delete(APP_NAME)
    serve.delete(config.tinker.app_name)
    stop_inference(config.inference_app_name)


@pytest.fixture(scope="module")
async def registered(server_url) -> tuple[HTTPBackend, TrainableModel]:
    backend = HTTPBackend(server_url, api_key=API_KEY)
    model = TrainableModel(name="http-model", project="http-tests", base_model="tiny", config=CONFIG)
    await model.register(backend)
    return backend, model


async def rollout(model: TrainableModel, prompt: str) -> Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0
    )
    choice = completion.choices[0]
    reward = float(sampled_tokens(choice).token_ids[0] % 2)  # varies within a group
    return Trajectory(messages_and_choices=[*messages, choice], reward=reward)


async def groups_of(model: TrainableModel) -> list[TrajectoryGroup]:
    groups = []
    for prompt in PROMPTS:
        group = await TrajectoryGroup(rollout(model, prompt) for _ in range(4))
        group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0  # never all equal
        groups.append(group)
    return groups


def test_auth_is_required_off_localhost() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    require_auth_off_localhost("127.0.0.1", None)
    require_auth_off_localhost("0.0.0.0", "key")
    with pytest.raises(AuthRequiredError, match="api_key"):
        require_auth_off_localhost("0.0.0.0", None)


def test_a_refused_public_start_deploys_nothing(ray_cluster) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client

    with pytest.raises(AuthRequiredError, match="api_key"):
        start_training_server(TrainingServerConfig(), host="0.0.0.0", port=free_port(), app_name="public")
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is not None:  # Serve ran before the call: it still listens where it did, without the app
        assert is_loopback(client.http_config.host)
        assert "public" not in serve.status().applications


async def test_register_names_the_endpoint_and_step_zero(server_url, registered) -> None:
    backend, model = registered
    assert model.base_url == f"{server_url}/http/v1"
    assert model.api_key == API_KEY
    assert await model.get_step() == 0
    models = await model.openai_client().models.list()
    assert "http-model" in {m.id for m in models.data}
    # registering again is idempotent; the same name with another config is a conflict
    await model.register(backend)
    other = TrainableModel(
        name="http-model",
        project="http-tests",
        base_model="tiny",
        config=CONFIG.model_copy(update={"seed": 7}),
    )
    with pytest.raises(RemoteTrainingError) as conflict:
        await other.register(HTTPBackend(server_url, api_key=API_KEY))
    assert conflict.value.status == 409


async def test_train_streams_each_gradient_step_and_serves_the_new_step(registered) -> None:
    backend, model = registered
    groups = await groups_of(model)
    lines = [
        m async for m in model.train_stream(groups, TrainConfig(learning_rate=1e-3, num_gradient_steps=2))
    ]
    assert len(lines) == 3
    assert all(isinstance(line, GradientStep) and "loss/train" in line.metrics for line in lines[:2])
    assert isinstance(lines[2], TrainResult) and lines[2].step == 1
    assert "time/wait_for_replicas_seconds" in lines[2].metrics and "loss/train" in lines[2].metrics
    assert await model.get_step() == 1
    served = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(1), messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert served.model == "http-model@1"
    # the train call's groups were saved on the server under the step they were sampled at
    saved = read_trajectory_groups(f"{backend.model_dir(model)}/trajectories/train/0000.parquet")
    assert [len(g.trajectories) for g in saved] == [4, 4]
    assert saved[0].trajectories[1].reward == 0.0


async def test_log_and_delete_checkpoints(registered) -> None:
    backend, model = registered
    groups = await groups_of(model)
    metrics = await model.log(groups, split="val")
    assert metrics["val/num_trajectories"] == 8.0
    assert (await model.log(groups[:1], split="val"))["val/num_trajectories"] == 4.0
    # the same step: the file keeps both calls' groups
    assert len(read_trajectory_groups(f"{backend.model_dir(model)}/trajectories/val/0001.parquet")) == 3
    for _ in range(2):
        assert await model.train(await groups_of(model), TrainConfig(learning_rate=1e-3), verbose=False) > 1
    assert await model.get_step() == 3
    # val/reward exists only at step 1: steps 1 (best) and 3 (latest) stay
    assert await model.delete_checkpoints("val/reward") == [2]
    with pytest.raises(Exception, match="tracked by the server"):
        model.tracker  # noqa: B018


async def test_bad_requests_get_error_json_and_change_nothing(server_url, registered) -> None:
    _, model = registered
    step = await model.get_step()
    async with httpx.AsyncClient(base_url=f"{server_url}/_art", timeout=60) as client:
        unauthenticated = await client.post("/step", json={"model": model.name})
        assert unauthenticated.status_code == 401
        assert unauthenticated.json()["error"]["type"] == "authentication_error"
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        not_json = await client.post("/train", content=b"{not json", headers=headers)
        assert not_json.status_code == 400 and "TrainRequest" in not_json.json()["error"]["message"]
        # what a web page can make a browser send: a text body, or any body with the page's Origin
        spec = ModelSpec.of(model).model_dump_json()
        text = {**headers, "Content-Type": "text/plain"}
        as_text = await client.post("/register", content=spec, headers=text)
        assert as_text.status_code == 415 and "application/json" in as_text.json()["error"]["message"]
        page = {**headers, "Origin": "https://evil.test"}
        from_page = await client.post("/register", content=spec, headers=page)
        assert from_page.status_code == 403 and from_page.json()["error"]["type"] == "permission_error"
        unknown = await client.post("/step", json={"model": "nobody"}, headers=headers)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        escape = await client.post(
            "/log", json={"model": model.name, "groups": [], "split": "../x"}, headers=headers
        )
        assert escape.status_code == 400 and "split" in escape.json()["error"]["message"]
        pickle_like = await client.post("/step", content=b"\x80\x04\x95", headers=headers)
        assert pickle_like.status_code == 400
    # a trajectory without token data is refused before anything trains or is saved
    untrainable = TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "x"},
                    Choice.model_validate(NO_LOGPROBS),
                ],
                reward=float(r),
            )
            for r in range(2)
        ]
    )
    with pytest.raises(RemoteTrainingError) as refused:
        await model.train([untrainable], verbose=False)
    assert refused.value.status == 400
    assert await model.get_step() == step
    with pytest.raises(RemoteTrainingError) as wrong_key:
        await HTTPBackend(server_url, api_key="wrong").get_step(model)
    assert wrong_key.value.status == 401


def test_an_example_script_trains_through_the_server_without_ray(server_url) -> None:
    """The agent examples' loop takes --server: the same script, no Ray in the driver (rollouts run on its
    own event loop), trains a model of its own on the server."""
    script = Path(__file__).parents[1] / "examples" / "temporal_clue" / "train.py"
    command = [
        sys.executable, str(script), "--server", server_url, "--model", "tiny", "--name", "http-clue",
        "--steps", "1", "--groups-per-step", "2", "--group-size", "3", "--lora-rank", "8",
    ]  # fmt: skip
    env = {**os.environ, "ART_RAY_API_KEY": API_KEY, "RAY_ADDRESS": ""}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["task"] == "temporal_clue" and result["steps"] == 1
    assert "ray.init" not in run.stderr and "Started a local Ray instance" not in run.stderr


async def test_trajectories_the_endpoint_captured_train_through_the_server(registered) -> None:
    """Capture sessions with an HTTPBackend: plain HTTP to the endpoint, and the turns train through the
    training server."""
    _, model = registered
    step = await model.get_step()

    async def captured(prompt: str, reward: float) -> Trajectory:
        async with model.capture() as session:
            await session.openai_client(max_retries=0).chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=4
            )
            return await session.trajectory(reward=reward)

    rewards = (0.0, 1.0, 0.0, 1.0)
    groups = [TrajectoryGroup([await captured(prompt, r) for r in rewards]) for prompt in PROMPTS]
    assert all(len(t.trainable_choices()) == 1 for g in groups for t in g)
    assert await model.train(groups, TrainConfig(learning_rate=1e-3), verbose=False) == step + 1


async def test_a_runs_traffic_and_release_through_the_server(registered) -> None:
    """HTTPBackend's traffic verbs go through the training server: labeled turns past a cursor, and the
    run's release (its arms, its evidence, a move it cannot make)."""
    from art_ray import ReleasePolicy, RemoteTrainingError, TrafficConfig

    backend, _ = registered
    update = {"share_trainer": True, "traffic": TrafficConfig(), "release": ReleasePolicy()}
    model = TrainableModel(
        name="http-traffic", project="http-tests", base_model="tiny", config=CONFIG.model_copy(update=update)
    )
    await model.register(backend)
    reply = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, metadata={"task": "t"}
    )
    await model.feedback(reply.id, score=1.0)
    matured = await model.matured_traffic()
    assert [t.stored.completion_id for t in matured.turns] == [reply.id]
    assert matured.turns[0].stored.turn.metadata == {"task": "t"} and matured.labeled == 1
    assert (await model.matured_traffic(after=matured.cursor)).turns == []
    state = await model.release()
    assert state.release is not None and (state.release.stable, state.release.status) == (0, "stable")
    assert state.arms[0].turns == 1 and state.arms[0].score.n == 1
    with pytest.raises(RemoteTrainingError, match="no candidate"):
        await model.release("promote")
    await backend.delete_run(model)


async def test_a_run_key_sees_only_its_own_run_on_both_apis(server_url, registered, capsys) -> None:
    """Issue 27's isolation: alice's key registers a run (which joins the trainer of the admin's run) and
    samples, captures and trains it; bob's key is answered 404 for it on every route, as for a name
    nobody registered, and for the admin's run too. The admin key sees both."""
    from art_ray import keys
    from art_ray.access import KeyGrant

    admin, admin_model = registered
    admin_step = await admin.get_step(admin_model)
    alice_key = await keys.create_key(KeyGrant(name="http-alice", max_train_tokens=8))
    bob_key = await keys.create_key(KeyGrant(name="http-bob", max_concurrent_requests=8))
    own = TrainableModel(
        name="http-alice-run",
        project="http-tests",
        base_model="tiny",
        config=CONFIG.model_copy(update={"share_trainer": True}),
    )
    await own.register(HTTPBackend(server_url, api_key=alice_key))
    assert own.api_key == alice_key and await admin.get_step(own) == 0

    alice_client = own.openai_client()
    reply = await alice_client.chat.completions.create(
        model=own.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.model == f"{own.name}@0"
    listed = {card.id for card in (await alice_client.models.list()).data}
    assert listed == {own.name, f"{own.name}@0"}

    inference = own.base_url
    bob_client = openai.AsyncOpenAI(base_url=inference, api_key=bob_key, max_retries=0)
    bob_claude = anthropic.AsyncAnthropic(
        base_url=inference.removesuffix("/v1"), api_key=bob_key, max_retries=0
    )
    for name in (own.name, f"{own.name}@0", admin_model.name, "no-such-run"):
        with pytest.raises(openai.NotFoundError) as hidden:
            await bob_client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert hidden.value.body["message"] == f"The model `{name}` does not exist.", name
        with pytest.raises(openai.NotFoundError):
            await bob_client.responses.create(model=name, input="hi", max_output_tokens=16)
        with pytest.raises(openai.NotFoundError):
            await bob_client.completions.create(model=name, prompt="hi", max_tokens=2)
        with pytest.raises(anthropic.NotFoundError):
            await bob_claude.messages.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert not {card.id for card in (await bob_client.models.list()).data} & {own.name, admin_model.name}

    async with own.capture() as session:  # alice's session: bob can neither open nor read one like it
        await session.openai_client(max_retries=0).chat.completions.create(
            model=own.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        async with httpx.AsyncClient(base_url=inference, timeout=60) as client:
            bob = {"Authorization": f"Bearer {bob_key}"}
            opened = await client.post("/capture/sessions", json={"model": own.name}, headers=bob)
            assert opened.status_code == 404 and opened.json()["error"]["param"] == "model"
            read = await client.get(f"/capture/sessions/{session.id}", headers=bob)
            assert read.status_code == 404
            # her session's base URL with bob's key: not his session, and not his model
            chat = {"model": own.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            sampled = await client.post(f"{session.base_url}/chat/completions", json=chat, headers=bob)
            assert sampled.status_code == 404
        trajectory = await session.trajectory(reward=1.0)

    bob_backend = HTTPBackend(server_url, api_key=bob_key)
    routes = {
        "step": bob_backend.get_step(own),
        "log": bob_backend.log(own, [], "val", {"x": 1.0}),
        "delete_checkpoints": bob_backend.delete_checkpoints(own, steps_to_keep=[]),
        "train": model_train(bob_backend, own, trajectory),
        "delete_run": bob_backend.delete_run(own),
        "train_sft": sft(bob_backend, own, trajectory),
    }
    for route, call in routes.items():
        with pytest.raises(RemoteTrainingError) as hidden:
            await call
        assert hidden.value.status == 404 and hidden.value.type == "not_found_error", route
    with pytest.raises(RemoteTrainingError) as taken:  # a name can't be taken over
        await TrainableModel(name=own.name, project="p", base_model="tiny", config=CONFIG).register(
            bob_backend
        )
    assert taken.value.status == 409

    # alice's quota: a call packing more tokens than her key allows is refused whole
    group = TrajectoryGroup([trajectory.model_copy(update={"reward": float(i % 2)}) for i in range(4)])
    with pytest.raises(RemoteTrainingError) as over:
        await own.train([group], verbose=False)
    assert over.value.status == 413 and "max_train_tokens" in str(over.value)
    assert await admin.get_step(own) == 0 and await admin.get_step(admin_model) == admin_step

    # what an operator sees: names, limits, runs; never a key
    assert await asyncio.to_thread(cli_main, ["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert "http-alice: concurrent None, train tokens 8; runs: http-alice-run" in listing
    assert alice_key not in listing

    await keys.revoke_key("http-bob")
    with pytest.raises(RemoteTrainingError) as revoked:
        await bob_backend.get_step(own)
    assert revoked.value.status == 401
    with pytest.raises(openai.AuthenticationError):
        await bob_client.models.list()

    # alice deletes her run: its names are unknown to everyone, the admin's run goes on
    await own.backend.delete_run(own, purge_checkpoints=True)
    with pytest.raises(openai.NotFoundError):
        await alice_client.chat.completions.create(
            model=own.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(RemoteTrainingError) as deleted:
        await admin.get_step(own)
    assert deleted.value.status == 404 and await admin.get_step(admin_model) == admin_step


async def sft(backend: HTTPBackend, model: TrainableModel, trajectory: Trajectory) -> None:
    async for _ in backend.train_sft(model, [trajectory], SFTConfig()):
        pass


async def model_train(backend: HTTPBackend, model: TrainableModel, trajectory: Trajectory) -> None:
    group = TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])
    async for _ in backend.train(model, [group], TrainConfig()):
        pass


def test_the_tinker_sdk_trains_samples_and_sees_only_its_own_runs(server_url) -> None:
    """Issue 28: the official `tinker` SDK, pointed at the server with a `tml-` run key, trains a LoRA run
    (cross_entropy forward_backward + optim_step), samples snapshots of it, and the run is served on the
    OpenAI endpoint under its run name; another key finds none of it."""
    import tinker
    from tinker import types as T

    from art_ray import keys
    from art_ray.access import KeyGrant

    carol_key = asyncio.run(keys.create_key(KeyGrant(name="tinker-carol"), prefix="tml-"))
    dave_key = asyncio.run(keys.create_key(KeyGrant(name="tinker-dave"), prefix="tml-"))
    carol = tinker.ServiceClient(base_url=server_url, api_key=carol_key)
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="is not served here"):  # at once, not retried
        carol.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    assert time.monotonic() - started < 30

    training = carol.create_lora_training_client(base_model="tiny", rank=8).result()
    run = training.model_id.replace(":", "-")
    tokenizer = training.get_tokenizer()  # get_info's tokenizer_id: the local folder, offline
    prompt = tokenizer.encode("Name a color:")
    answer = tokenizer.encode(" teal teal teal")
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(prompt + answer[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData(data=prompt[1:] + answer, dtype="int64"),
            "weights": T.TensorData(data=[0.0] * (len(prompt) - 1) + [1.0] * len(answer), dtype="float32"),
        },
    )
    greedy = T.SamplingParams(max_tokens=len(answer), temperature=0.0)
    base = carol.create_sampling_client(base_model="tiny").result()
    sampled = base.sample(T.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    before = sampled.tokens
    # compute_logprobs scores the prompt on the same engines: the sampled tokens' logprobs again
    scored = base.compute_logprobs(T.ModelInput.from_ints(prompt + before)).result()
    assert scored[0] is None and len(scored) == len(prompt) + len(before)
    assert scored[len(prompt) :] == pytest.approx(sampled.logprobs, abs=0.05)
    # as Tinker's sampler, a sample's logprobs are those of the distribution it was drawn from (at its
    # temperature), while compute_logprobs scores at temperature 1 (it takes no temperature)
    warm = T.SamplingParams(max_tokens=len(answer), temperature=0.5, seed=7)
    tempered = base.sample(T.ModelInput.from_ints(prompt), 1, warm).result().sequences[0]
    rescored = base.compute_logprobs(T.ModelInput.from_ints(prompt + tempered.tokens)).result()[len(prompt) :]
    assert max(abs(a - b) for a, b in zip(rescored, tempered.logprobs, strict=True)) > 0.05

    # the tiny model's attention-only LoRA lowers this loss but cannot memorise the answer: ~63 -> ~53
    losses = []
    for _ in range(4):
        backward = training.forward_backward([datum], "cross_entropy")
        stepped = training.optim_step(T.AdamParams(learning_rate=1e-2))
        losses.append(backward.result().metrics["loss:sum"])
        stepped.result()
    assert losses[-1] < losses[0] - 5, losses
    snapshot = training.save_weights_and_get_sampling_client().result()
    trained = snapshot.sample(T.ModelInput.from_ints(prompt), 2, greedy).result()
    taught = trained.sequences[0].tokens
    assert taught != before and trained.sequences[1].tokens == taught
    assert all(lp <= 0 for lp in trained.sequences[0].logprobs)
    state = training.save_state("taught").result().path  # adapter, optimizer state, step

    # the run moves on; the sampling client stays on its snapshot
    other = T.Datum(
        model_input=T.ModelInput.from_ints(prompt + before[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData(data=prompt[1:] + before, dtype="int64"),
            "weights": T.TensorData(data=[0.0] * (len(prompt) - 1) + [1.0] * len(before), dtype="float32"),
        },
    )
    for _ in range(4):
        training.forward_backward([other], "cross_entropy").result()
        training.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    assert snapshot.sample(T.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens == taught

    # the same snapshot on the OpenAI endpoint, for carol's key only
    endpoint = f"{server_url}/http/v1"
    completion = openai.OpenAI(base_url=endpoint, api_key=carol_key, max_retries=0).completions.create(
        model=f"{run}@4", prompt=prompt, max_tokens=len(answer), temperature=0
    )
    assert completion.choices[0].token_ids == taught
    dave_openai = openai.OpenAI(base_url=endpoint, api_key=dave_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        dave_openai.completions.create(model=run, prompt=prompt, max_tokens=2)

    # a new training client from the saved state answers as the run did then
    copy = carol.create_training_client_from_state_with_optimizer(state).result()
    assert copy.get_info().lora_rank == 8
    copied = copy.save_weights_and_get_sampling_client().result()
    assert copied.sample(T.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens == taught

    dave = tinker.ServiceClient(base_url=server_url, api_key=dave_key)
    path = training.save_weights_for_sampler("final").result().path
    with pytest.raises(tinker.NotFoundError):
        dave.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.NotFoundError):
        dave.create_training_client_from_state(state).result()
    dave_rest = tinker.RestClient(base_url=server_url, api_key=dave_key)
    assert training.model_id not in [
        r.training_run_id for r in dave_rest.list_training_runs().result().training_runs
    ]
    carol_rest = tinker.RestClient(base_url=server_url, api_key=carol_key)
    listed = carol_rest.list_checkpoints(training.model_id).result().checkpoints
    assert {path, state} <= {checkpoint.tinker_path for checkpoint in listed}
    status = cluster_status()  # `art-ray status` lists the run and its checkpoints
    [listed_run] = [entry for entry in status.tinker_runs if entry.model_id == training.model_id]
    assert listed_run.owner == "tinker-carol" and {path, state} <= set(listed_run.checkpoints)
    assert state in format_status(status)

    # the engines keep a run's last 3 snapshots (keep_versions): an older one is a clear, unretried error
    for _ in range(2):
        training.forward_backward([other], "cross_entropy").result()
        training.optim_step(T.AdamParams(learning_rate=1e-2)).result()
        training.save_weights_for_sampler("later").result()
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="no longer served"):
        snapshot.sample(T.ModelInput.from_ints(prompt), 1, greedy).result()
    assert time.monotonic() - started < 30
    carol.close("success").result(timeout=60)
    dave.close("success").result(timeout=60)


def test_tinker_cookbooks_supervised_loop_lowers_its_loss_on_the_server(server_url, tmp_path) -> None:
    """tinker-cookbook's chat_sl recipe, unchanged, against the server (offline: the base model named by
    its local folder, as the recipe loads its tokenizer from that name)."""
    import tinker_cookbook

    from art_ray import keys
    from art_ray.access import KeyGrant

    key = asyncio.run(keys.create_key(KeyGrant(name="tinker-cookbook"), prefix="tml-"))
    dataset = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    log_path = tmp_path / "chat_sl"
    recipe = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.chat_sl.train",
        f"base_url={server_url}",
        f"model_name={resolve_base_model('tiny')}",
        "renderer_name=qwen3_instruct",  # SmolLM2's ChatML
        f"dataset={dataset}",
        "batch_size=8",
        "lora_rank=8",
        "learning_rate=1e-2",
        "max_length=256",
        "max_steps=4",
        "save_every=0",
        "eval_every=0",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]
    completed = subprocess.run(
        recipe, env=cookbook_environment(key), capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    nll = [step["train_mean_nll"] for step in metrics if "train_mean_nll" in step]
    assert len(nll) == 4 and nll[-1] < nll[0] - 0.1, nll


def test_the_training_document_lists_every_route_behind_the_key(server_url) -> None:  # noqa: ANN001
    from art_ray.remote.protocol import ROUTES
    from art_ray.remote.server import app

    url = f"{server_url}/_art/openapi.json"
    assert httpx.get(url).status_code == 401
    document = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).json()
    served = {route.path for route in app.routes}
    assert set(document["paths"]) == {*ROUTES, "/health", "/openapi.json"} == served
    train = document["paths"]["/train"]["post"]
    assert set(train["responses"]["200"]["content"]) == {"application/x-ndjson"}
    assert train["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/TrainRequest")


async def test_a_bounded_fuzz_of_the_training_routes_and_the_tinker_api_finds_nothing(  # noqa: ANN001
    server_url, registered
) -> None:
    """bench/fuzz.py's bounded form on the deployed training routes (most bodies naming the registered
    model, /delete_run never) and Tinker API (stateful: a session, a sampler on the served base model,
    samples, their futures); no replica restarted, and the model still trains."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import fuzz

    _, model = registered
    before = fuzz.replica_actors()
    training = await asyncio.to_thread(
        fuzz.fuzz_api,
        f"{server_url}/_art",
        fuzz.bearer(API_KEY),
        model.name,
        max_examples=4,
        spare=fuzz.SPARE_PATHS,
    )
    tinker_report = await asyncio.to_thread(
        fuzz.fuzz_api, f"{server_url}/api/v1", {"X-API-Key": API_KEY}, None, max_examples=4
    )
    failures = "\n".join(
        f"{f.kind} {f.operation} {f.status}: {f.message}\n  {f.curl}"
        for f in [*training.findings, *tinker_report.findings]
    )
    assert not failures, failures
    assert len(training.by_operation) == 12 and len(tinker_report.by_operation) == 24
    assert before <= fuzz.replica_actors()
    step = await model.get_step()
    await model.train(await groups_of(model))
    assert await model.get_step() == step + 1
