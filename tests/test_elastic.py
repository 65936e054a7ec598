"""Elastic inference: Serve scales the replicas with the load (ModelConfig.autoscaling), a replica it adds
serves the newest adapter version before it takes traffic, and no request fails while it scales up or down
(a replica Serve removes finishes the requests it has)."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import torch
from conftest import free_port
from ray import serve

from art_ray.adapters.lora_files import adapter_shapes
from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, publish_adapter
from art_ray.adapters.spec import LoRASpec
from art_ray.model_config import ReplicaAutoscaling
from art_ray.models import TINY, prepare
from art_ray.serving.config import ServingConfig
from art_ray.serving.engine_config import EngineConfig
from art_ray.serving.launch import start_inference, stop_inference

pytestmark = pytest.mark.slow

APP = "elastic"
MODEL = "elastic-model"
SPEC = LoRASpec(r=8, alpha=16)
PROMPT = [{"role": "user", "content": "Count to ten."}]


def running_replicas() -> int:
    deployment = serve.status().applications[APP].deployments[INFERENCE_DEPLOYMENT]
    return deployment.replica_states.get("RUNNING", 0)


async def served_steps() -> list[list[int]]:
    handle = serve.get_deployment_handle(INFERENCE_DEPLOYMENT, APP)
    served = await handle.broadcast("served_models").results_async(timeout_s=60)
    return [models.get(MODEL, []) for models in served]


async def test_serve_adds_a_replica_under_load_that_serves_the_newest_step_and_drops_it_after(
    ray_cluster,
) -> None:
    base_model = str(prepare(TINY))
    config = ServingConfig(
        engine=EngineConfig(model=base_model, max_model_len=512, threads=1),
        app_name=APP,
        route_prefix=f"/{APP}",
        replica_cpus=0,
        autoscaling=ReplicaAutoscaling(
            min_replicas=1,
            max_replicas=2,
            target_ongoing_requests=1,
            upscale_delay_s=0,
            downscale_delay_s=5,
            metrics_interval_s=0.5,
            look_back_period_s=2,
        ),
    )
    base_url = await asyncio.to_thread(start_inference, config, "127.0.0.1", free_port())
    try:
        assert running_replicas() == 1
        generator = torch.Generator().manual_seed(5)
        for step in (0, 1):
            tensors = {
                name: torch.randn(shape, generator=generator) * 0.3
                for name, shape in sorted(adapter_shapes(base_model, SPEC).items())
            }
            assert await publish_adapter(MODEL, step, base_model, SPEC, tensors) >= 1
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        versions: list[int] = []
        failures: list[BaseException] = []
        load = asyncio.Event()
        load.set()

        async def ask() -> None:
            try:
                reply = await client.chat.completions.create(
                    model=MODEL, messages=PROMPT, max_tokens=48, extra_body={"ignore_eos": True}
                )
                versions.append(reply.choices[0].model_extra["policy_version"])
            except Exception as error:  # every request must succeed: collected and asserted below
                failures.append(error)

        async def heavy_user() -> None:
            while load.is_set():
                await ask()

        start = time.monotonic()
        heavy_users = [asyncio.ensure_future(heavy_user()) for _ in range(6)]
        while running_replicas() < 2 or any(1 not in steps for steps in await served_steps()):
            assert time.monotonic() - start < 240, "Serve did not add a replica under load"
            assert not failures, failures
            await asyncio.sleep(0.5)
        scaled_up_s = time.monotonic() - start
        steps = await served_steps()
        assert len(steps) == 2 and all(served == [0, 1] for served in steps), steps

        # the load stops; one light user keeps requests in flight while Serve removes a replica
        load.clear()
        await asyncio.gather(*heavy_users)
        start = time.monotonic()
        while running_replicas() > 1:
            assert time.monotonic() - start < 180, "Serve did not remove the idle replica"
            await ask()
        scaled_down_s = time.monotonic() - start
        for _ in range(3):
            await ask()
        assert not failures, failures
        assert versions and set(versions) == {1}  # `name` is the newest step on every replica
        print(
            f"elastic: second replica serving {scaled_up_s:.1f} s after the load began; "
            f"back to one replica {scaled_down_s:.1f} s after it ended; {len(versions)} requests, 0 failed"
        )
    finally:
        stop_inference(APP)
