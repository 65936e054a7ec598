"""Capture sessions on the session app (2 replicas of `tiny`): the endpoint records what it sampled for any
client, and the recorded turns become a Trajectory whose assistant tokens are the sampled ones."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import ray
from transformers import AutoTokenizer

from art_ray import CaptureError, CaptureSession, Model, SamplingParams, TrajectoryGroup, sampled_tokens
from art_ray.capture.store import CaptureStore
from art_ray.capture.turns import CapturedTurn
from art_ray.trainer.batches import tokenize_groups

pytestmark = pytest.mark.slow


def model_of(app) -> Model:  # noqa: ANN001
    return Model(name=app.model, project="capture", base_url=app.base_url, api_key=app.api_key)


def sampled_ids(choice) -> list[int]:  # noqa: ANN001
    return list(choice.model_extra["token_ids"])


async def test_a_multi_turn_conversation_becomes_one_trajectory_of_the_sampled_choices(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        client = session.openai_client(max_retries=0)
        messages: list = [{"role": "user", "content": "Name a color."}]
        seen = []
        for follow_up in ("And another?", "One more."):
            # several requests: Serve spreads them over both replicas, the recording follows each
            completion = await client.chat.completions.create(
                model=model.name, messages=messages, max_tokens=6, temperature=1.0
            )
            seen.append(completion.choices[0])
            messages += [completion.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": follow_up}]
        trajectory = await session.trajectory(reward=0.5, metrics={"turns": 2})
    with pytest.raises(CaptureError, match="has ended"):  # reading the trajectory ended the session
        await session.turns()
    async with httpx.AsyncClient() as http:  # and the endpoint dropped its turns
        gone = await http.get(
            f"{model.base_url}/capture/sessions/{session.id}",
            params={"model": model.name},
            headers={"Authorization": f"Bearer {model.api_key}"},
        )
    assert gone.status_code == 404
    choices = trajectory.trainable_choices()
    assert len(choices) == 2 and not trajectory.additional_histories
    assert [sampled_tokens(c).token_ids for c in choices] == [sampled_ids(c) for c in seen]
    assert [sampled_tokens(c).logprobs for c in choices] == [
        [t.logprob for t in c.logprobs.content] for c in seen
    ]
    assert trajectory.reward == 0.5 and trajectory.metrics["turns"] == 2
    assert [m["content"] for m in trajectory.messages() if m["role"] == "user"] == [
        "Name a color.",
        "And another?",
    ]
    trajectory.check_trainable()


async def test_a_stream_is_recorded_as_the_client_received_it(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        stream = await session.openai_client(max_retries=0).chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=8,
            temperature=0.6,
            top_p=0.9,
            stream=True,
        )
        text, ids, completion_ids = "", [], set()
        async for chunk in stream:
            completion_ids.add(chunk.id)
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += choice.model_extra.get("token_ids") or []
        (turn,) = await session.turns()
        trajectory = await session.trajectory(reward=1.0)
    (choice,) = trajectory.trainable_choices()
    assert choice.message.content == text
    assert sampled_tokens(choice).token_ids == ids and len(ids) > 0
    assert choice.model_extra["prompt_token_ids"]
    # what the stream was sampled with, and its id, are recorded though no chunk carries them
    assert sampled_tokens(choice).sampling_params == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=8)
    assert {turn.completion_id} == completion_ids
    trajectory.check_trainable()


async def test_the_session_header_on_the_plain_endpoint_records_too(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        client = openai.AsyncOpenAI(
            base_url=model.base_url, api_key=model.api_key, default_headers=session.headers, max_retries=0
        )
        completion = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        (turn,) = await session.turns()
        with pytest.raises(openai.BadRequestError, match="16-64 characters"):  # a guessable id
            await client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                extra_headers={"X-Art-Ray-Session": "1"},
            )
    assert turn.choice["token_ids"] == sampled_ids(completion.choices[0])
    assert turn.request_messages == [{"role": "user", "content": "Hi"}]


async def test_a_session_is_bound_to_its_key_model_and_lifetime(inference_app) -> None:
    model = model_of(inference_app)
    async with model.capture() as session:
        await session.openai_client(max_retries=0).chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        url = f"{model.base_url}/capture/sessions/{session.id}"
        async with httpx.AsyncClient() as http:
            wrong_key = await http.get(
                url, params={"model": model.name}, headers={"Authorization": "Bearer x"}
            )
            assert wrong_key.status_code == 401 and "turns" not in wrong_key.text
        other_model = session.model_copy(update={"model": "another-model"})
        with pytest.raises(CaptureError, match="404"):
            await other_model.turns()
        with pytest.raises(openai.BadRequestError, match="records model"):  # another model in this session
            await session.openai_client(max_retries=0).chat.completions.create(
                model="another-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        with pytest.raises(openai.BadRequestError, match="`n` must be 1"):
            await session.openai_client(max_retries=0).chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2
            )
        assert len(await session.turns()) == 1  # the refused requests recorded nothing
    with pytest.raises(CaptureError, match="404"):  # closed with the block
        await CaptureSession(**session.model_dump()).turns()

    async with model.capture(ttl_s=1) as short:
        await asyncio.sleep(1.5)
        with pytest.raises(CaptureError, match="not found or expired"):
            await short.turns()
        with pytest.raises(openai.NotFoundError, match="not found or expired"):
            await short.openai_client(max_retries=0).chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )


async def test_the_store_refuses_new_turns_at_its_memory_cap(ray_cluster) -> None:
    store = CaptureStore.remote(max_bytes=2000, default_ttl_s=60)
    named = "client-drawn-id-0123456789"  # a session the client named: its first turn opens it
    assert await store.admit.remote(named, "digest", "m") is None
    assert await store.read.remote(named, "digest", "m") == []
    assert (await store.admit.remote(named, "other digest", "m")).status == 404
    assert await store.close.remote(named, "digest") == []
    assert (await store.admit.remote(named, "digest", "m")).status == 404  # a closed id is not reopened
    session = await store.open.remote("m", "digest")
    turn = CapturedTurn(
        request_messages=[{"role": "user", "content": "x" * 2500}], choice={}, model="m", created_at=0.0
    )
    assert await store.admit.remote(session.id, "digest", "m") is None
    assert await store.append.remote(session.id, "digest", turn)
    refused = await store.admit.remote(session.id, "digest", "m")
    assert refused.status == 429 and "cap 2000" in refused.message
    assert await store.read.remote(session.id, "other digest", "m") is None
    assert len(await store.close.remote(session.id, "digest")) == 1
    assert (await store.stats.remote())["bytes"] == 0  # closed: its bytes are freed
    ray.kill(store)


async def test_a_langchain_chat_model_is_recorded_with_the_logprobs_it_received(inference_app) -> None:
    from langchain_openai import ChatOpenAI

    model = model_of(inference_app)
    async with model.capture() as session:
        llm = ChatOpenAI(
            model=model.name, base_url=session.base_url, api_key=session.api_key, max_tokens=8, logprobs=True
        )
        reply = await llm.ainvoke("Name a color.")
        trajectory = await session.trajectory(reward=1.0)
    (choice,) = trajectory.trainable_choices()
    assert choice.message.content == reply.content
    received = [entry["logprob"] for entry in reply.response_metadata["logprobs"]["content"]]
    assert sampled_tokens(choice).logprobs == received
    trajectory.check_trainable()


async def test_a_langgraph_agent_with_a_tool_is_recorded_with_its_tools(inference_app) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def lookup(word: str) -> str:
        """Look a word up in the dictionary."""
        return f"{word}: a word"

    model = model_of(inference_app)
    async with model.capture() as session:
        llm = ChatOpenAI(
            model=model.name,
            base_url=session.base_url,
            api_key=session.api_key,
            max_tokens=24,
            temperature=0.7,
        )
        agent = create_react_agent(llm, tools=[lookup])
        state = await agent.ainvoke(
            {"messages": [("user", "What does 'apple' mean?")]}, {"recursion_limit": 6}
        )
        turns = await session.turns()
        trajectory = await session.trajectory(reward=1.0)
    answers = [m for m in state["messages"] if m.type == "ai"]
    choices = [c for history in trajectory.histories() for c in history.trainable_choices()]
    assert len(choices) == len(answers) >= 1
    assert [c.message.content or "" for c in choices] == [m.content for m in answers]
    assert trajectory.tools[0]["function"]["name"] == "lookup"
    trajectory.check_trainable()
    # each turn was sampled at 0.7, is recorded so, and trains so: its tokens' logprobs at 0.7
    assert all(turn.completion_id and turn.completion_id.startswith("chatcmpl-") for turn in turns)
    assert {sampled_tokens(c).temperature for c in choices} == {0.7}
    group = TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])
    sequences, stats = tokenize_groups([group], AutoTokenizer.from_pretrained(inference_app.base_model))
    assert stats.choices_without_sampling_params == 0
    trained = {t for s in sequences for t, trains in zip(s.temperatures, s.trainable, strict=True) if trains}
    assert trained == {0.7}


async def test_an_openai_agents_sdk_run_is_recorded(inference_app) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    model = model_of(inference_app)
    async with model.capture() as session:
        agent = Agent(
            name="assistant",
            instructions="Answer in one word.",
            model=OpenAIChatCompletionsModel(model=model.name, openai_client=session.openai_client()),
            model_settings=ModelSettings(max_tokens=8, temperature=1.0),
        )
        result = await Runner.run(agent, "Name a color.", max_turns=1)
        trajectory = await session.trajectory(reward=1.0)
    (choice,) = trajectory.trainable_choices()
    assert choice.message.content == result.final_output
    assert trajectory.messages()[0] == {"role": "system", "content": "Answer in one word."}
    trajectory.check_trainable()
