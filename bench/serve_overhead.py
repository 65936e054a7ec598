"""Serve + OpenAI client vs the vLLM engine called directly: output tokens/s on the same prompts.

Both paths use the same EngineConfig (SmolLM2-135M, float32, one engine thread), the same step-0
adapter, the same concurrency and fixed-length outputs (ignore_eos), so the ratio is what the HTTP
hop, Serve's proxy and routing, vLLM's OpenAI layer and art-ray's middleware cost. The same app then serves
each request in its own capture session (opened, recorded, read back as a Trajectory, closed), rounds
alternated with plain requests (each round starting with the next path): capture_ratio is what recording
costs (median of --rounds each). The same requests through the Responses API (openai SDK) and Anthropic
Messages (anthropic SDK), in the same rounds: responses_ratio and messages_ratio against chat completions.
And the same chat requests to a second run whose traffic is stored (ModelConfig.traffic: each turn
appended to its traffic log before the last byte, a signed feedback token in each response):
traffic_ratio. Last line: {"bench": "serve_overhead", "ratio": serve tok/s / direct tok/s,
"capture_ratio", "responses_ratio", "messages_ratio", "traffic_ratio", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, median, print_result, print_table, start_local_ray  # noqa: E402

from art_ray.adapters.lora_files import initial_adapter, write_peft_adapter  # noqa: E402
from art_ray.adapters.spec import LoRASpec  # noqa: E402
from art_ray.models import resolve_base_model  # noqa: E402
from art_ray.serving.engine_config import EngineConfig  # noqa: E402

SPEC = LoRASpec(r=16, alpha=32)


def prompts(count: int) -> list[list[dict]]:
    topics = ["rivers", "cats", "the moon", "bread", "trains", "music", "rain", "chess"]
    return [
        [{"role": "user", "content": f"Write a short story about {topics[i % len(topics)]}."}]
        for i in range(count)
    ]


async def generated_tokens(engine, tokenizer, messages: list[dict], params, lora, request: str) -> int:  # noqa: ANN001
    """One chat request straight to the engine (AsyncLLM) with `lora`; the tokens it generated."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    final = None
    async for output in engine.generate(
        prompt, params, request_id=f"{request}-{time.time()}", lora_request=lora
    ):
        final = output
    return len(final.outputs[0].token_ids)


async def direct_tokens_per_second(engine_config: EngineConfig, requests: int, max_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_config.apply_env()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_config.vllm_kwargs()))
    folder = Path(tempfile.mkdtemp()) / "step0"
    write_peft_adapter(folder, initial_adapter(engine_config.model, SPEC), SPEC, engine_config.model)
    lora = LoRARequest("bench@0", 1, str(folder))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_config.model)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0)

    async def one(index: int, messages: list[dict]) -> int:
        return await generated_tokens(engine, tokenizer, messages, params, lora, f"r{index}")

    await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts(4))))  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts(requests))))
    elapsed = time.perf_counter() - start
    engine.shutdown()
    # its __del__ shuts it down again; at interpreter exit vLLM's module globals are gone and that raises
    engine = None  # type: ignore[assignment]
    gc.collect()
    return sum(counts) / elapsed


async def serve_tokens_per_second(
    engine_config: EngineConfig, requests: int, max_tokens: int, rounds: int
) -> dict[str, float]:
    """Median tok/s by path through the same app, rounds alternated: "chat"; "captured", each chat request
    in its own capture session, opened, recorded, read back as a Trajectory and closed, as a rollout does;
    "responses" and "messages", the same requests through those protocols' clients."""
    import anthropic
    import openai

    from art_ray import Model, TrafficConfig
    from art_ray.adapters.registry import get_registry, publish_adapter
    from art_ray.serving.config import ServingConfig
    from art_ray.serving.launch import start_inference, stop_local_cluster
    from art_ray.traffic.log import ensure_traffic_log

    start_local_ray()
    base_url = start_inference(ServingConfig(engine=engine_config, num_replicas=1), port=free_port())
    await publish_adapter("bench", 0, engine_config.model, SPEC, initial_adapter(engine_config.model, SPEC))
    # the same adapter as a run that stores its traffic
    await publish_adapter("stored", 0, engine_config.model, SPEC, initial_adapter(engine_config.model, SPEC))
    traffic_folder = tempfile.mkdtemp(prefix="art-ray-traffic-")
    await ensure_traffic_log("stored", traffic_folder, TrafficConfig()).folder.remote()
    await get_registry().set_traffic.remote("stored", True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = Model(name="bench", project="bench", base_url=base_url)

    async def one(messages: list[dict], chat: openai.AsyncOpenAI = client, name: str = "bench") -> int:
        response = await chat.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return response.usage.completion_tokens

    async def captured(messages: list[dict]) -> int:
        async with model.capture() as session:
            tokens = await one(messages, session.openai_client(max_retries=0, timeout=600))
            trajectory = await session.trajectory(reward=0.0)
        assert len(trajectory.trainable_choices()) == 1
        return tokens

    async def responses(messages: list[dict]) -> int:
        response = await client.responses.create(
            model="bench",
            input=messages,
            max_output_tokens=max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return response.usage.output_tokens

    claude = anthropic.AsyncAnthropic(
        base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=600
    )

    async def messages_api(messages: list[dict]) -> int:
        message = await claude.messages.create(
            model="bench",
            messages=messages,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True, "temperature": 1.0},  # anthropic 2.x has no temperature argument
        )
        return message.usage.output_tokens

    async def rate(run) -> float:  # noqa: ANN001
        start = time.perf_counter()
        counts = await asyncio.gather(*(run(m) for m in prompts(requests)))
        return sum(counts) / (time.perf_counter() - start)

    async def stored(messages: list[dict]) -> int:
        return await one(messages, name="stored")

    paths = {
        "chat": one,
        "captured": captured,
        "responses": responses,
        "messages": messages_api,
        "stored": stored,
    }
    await asyncio.gather(*(run(m) for run in paths.values() for m in prompts(4)))  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for index in range(rounds):  # each round starts with the next path: no path always runs first or last
        for name in names[index % len(names) :] + names[: index % len(names)]:
            rates[name].append(await rate(paths[name]))
    print({name: [round(value, 1) for value in values] for name, values in rates.items()}, flush=True)
    from art_ray.traffic.files import read_traffic

    expected = rounds * requests + 4  # every request of the rounds and the warm-up to the stored run
    kept = len(read_traffic(traffic_folder, Path(traffic_folder) / "segment.jsonl").turns)
    assert kept == expected, f"{kept} stored turns, {expected} requests"
    stop_local_cluster()
    return {name: median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="Serve rounds, plain and captured alternated")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine_config = EngineConfig(
        model=resolve_base_model(args.model), device="cpu", max_model_len=1024, threads=args.threads
    )
    direct = asyncio.run(direct_tokens_per_second(engine_config, args.requests, args.max_tokens))
    rates = asyncio.run(serve_tokens_per_second(engine_config, args.requests, args.max_tokens, args.rounds))
    served, captured = rates["chat"], rates["captured"]
    ratio = served / direct
    print_table(
        f"{args.requests} concurrent chat requests x {args.max_tokens} tokens, {args.model}, "
        f"{args.threads} engine thread(s)",
        ["path", "output tok/s"],
        [
            ["vLLM AsyncLLM direct", direct],
            ["art-ray Serve + openai client", served],
            ["ratio (Serve / direct)", ratio],
            ["Serve, each request in a capture session", captured],
            ["capture ratio (captured / plain Serve)", captured / served],
            ["Serve, Responses API (openai SDK)", rates["responses"]],
            ["responses ratio (Responses / chat)", rates["responses"] / served],
            ["Serve, Anthropic Messages (anthropic SDK)", rates["messages"]],
            ["messages ratio (Messages / chat)", rates["messages"] / served],
            ["Serve, a run that stores its traffic", rates["stored"]],
            ["traffic ratio (stored / plain Serve)", rates["stored"] / served],
        ],
    )
    print_result(
        {
            "bench": "serve_overhead",
            "ratio": round(ratio, 3),
            "direct_tok_s": round(direct, 1),
            "serve_tok_s": round(served, 1),
            "capture_ratio": round(captured / served, 3),
            "captured_tok_s": round(captured, 1),
            "responses_ratio": round(rates["responses"] / served, 3),
            "messages_ratio": round(rates["messages"] / served, 3),
            "responses_tok_s": round(rates["responses"], 1),
            "messages_tok_s": round(rates["messages"], 1),
            "traffic_ratio": round(rates["stored"] / served, 3),
            "stored_tok_s": round(rates["stored"], 1),
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "model": args.model,
        }
    )


if __name__ == "__main__":
    main()
