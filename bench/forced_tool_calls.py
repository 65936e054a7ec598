"""Forced tool calls against the tool's schema: vLLM's tool strict levels side by side, same engine settings.

Tools as LangChain, LangGraph and most clients send them (no `strict` field): `add(a: int, b: int)`.
For each level (ModelConfig.tool_strict_level) the app starts once; each tool_choice mode then sends
--requests chat requests at temperature 1 and counts the calls whose `arguments` parse as JSON and
validate against the tool's schema (jsonschema). Under "auto" the model may answer in text: its row counts
the calls it made and how many of those were valid.
Last line: {"bench": "forced_tool_calls", "<level>": {"<mode>": valid fraction, ...}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table, start_local_ray  # noqa: E402

from art_ray.adapters.lora_files import initial_adapter  # noqa: E402
from art_ray.adapters.spec import LoRASpec  # noqa: E402
from art_ray.models import default_tool_call_parser, resolve_base_model  # noqa: E402
from art_ray.serving.engine_config import EngineConfig  # noqa: E402

SPEC = LoRASpec(r=8, alpha=16)
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD}}
]
QUESTION = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
MODES: dict[str, object] = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "add"}},
    "auto": "auto",
}


def schema_valid(arguments: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments), ADD)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def count_calls(base_url: str, model: str, tool_choice: object, requests: int, max_tokens: int):
    """(requests answered with a call, calls whose arguments match the schema)."""
    import openai

    async def one() -> list[str]:
        response = await client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=max_tokens,
            temperature=1.0,
        )
        calls = response.choices[0].message.tool_calls or []
        return [call.function.arguments for call in calls if call.function.name == "add"][:1]

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        answers = await asyncio.gather(*(one() for _ in range(requests)))
    calls = [arguments for answer in answers for arguments in answer]
    return len(calls), sum(schema_valid(arguments) for arguments in calls)


async def measure(level: str, engine: EngineConfig, tool_call_parser: str | None, args) -> dict:  # noqa: ANN001
    from art_ray.adapters.registry import publish_adapter
    from art_ray.serving.config import ServingConfig
    from art_ray.serving.launch import start_inference, stop_inference

    config = ServingConfig(
        engine=engine, app_name=f"tools-{level}", tool_call_parser=tool_call_parser, tool_strict_level=level
    )
    base_url = start_inference(config, port=args.port)
    await publish_adapter("bench", 0, engine.model, SPEC, initial_adapter(engine.model, SPEC))
    results = {}
    for mode, tool_choice in MODES.items():
        results[mode] = await count_calls(base_url, "bench", tool_choice, args.requests, args.max_tokens)
        print(
            f"tool_strict_level={level} tool_choice={mode}: {results[mode][1]}/{results[mode][0]} calls valid"
        )
    stop_inference(config.app_name)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=12, help="requests per tool_choice mode and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", default="auto,parameter")
    args = parser.parse_args()
    args.port = free_port()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine = EngineConfig(model=resolve_base_model(args.model), device="cpu", max_model_len=1024, threads=1)
    start_local_ray()
    levels = args.levels.split(",")

    async def measure_levels() -> dict[str, dict]:
        parser_name = default_tool_call_parser(args.model)
        return {level: await measure(level, engine, parser_name, args) for level in levels}

    measured = asyncio.run(measure_levels())
    rows = [
        [mode, *(f"{measured[level][mode][1]}/{measured[level][mode][0]} calls" for level in levels)]
        for mode in MODES
    ]
    print_table(
        f"schema-valid `add` calls of {args.requests} requests per mode, tools without `strict`, "
        f"{args.model}, temperature 1",
        ["tool_choice", *(f"tool_strict_level={level}" for level in levels)],
        rows,
    )
    print_result(
        {
            "bench": "forced_tool_calls",
            **{
                level: {
                    mode: round(valid / args.requests, 3)
                    if mode != "auto"
                    else {"calls": calls, "valid": valid}
                    for mode, (calls, valid) in measured[level].items()
                }
                for level in levels
            },
            "requests": args.requests,
            "model": args.model,
        }
    )


if __name__ == "__main__":
    main()
