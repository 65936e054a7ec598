"""The CPU engine alone: output tokens/s when one run's samples fill a step (32 sequences, one adapter)
against four runs' samples batched together (128 sequences over 4 adapters), and 128 over one adapter.
It says how much a shared deployment gains from batching several runs in one engine step
(bench/multi_tenant.py). Rounds alternate the shapes; the table has every round, the JSON the medians.

    python bench/multi_lora_batch.py

Last line: {"bench": "multi_lora_batch", "tok_s": {shape: median}, "ratio_4_adapters", "ratio_1_adapter"}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import print_result, print_table  # noqa: E402
from serve_overhead import SPEC, generated_tokens, prompts  # noqa: E402

from art_ray.adapters.lora_files import initial_adapter, write_peft_adapter  # noqa: E402
from art_ray.models import resolve_base_model  # noqa: E402
from art_ray.serving.engine_config import EngineConfig  # noqa: E402

SHAPES = [(32, 1), (128, 4), (128, 1)]  # (sequences, adapters)


async def measure(args: argparse.Namespace) -> dict[tuple[int, int], list[float]]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    model = resolve_base_model(args.model)
    config = EngineConfig(
        model=model, device="cpu", max_model_len=512, threads=args.threads, max_num_seqs=128, max_loras=4
    )
    config.apply_env()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.vllm_kwargs()))
    adapters = []
    for index in range(4):
        folder = Path(tempfile.mkdtemp()) / f"run{index}"
        write_peft_adapter(folder, initial_adapter(model, SPEC, seed=index), SPEC, model)
        adapters.append(LoRARequest(f"run{index}", index + 1, str(folder)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    async def rate(sequences: int, count: int) -> float:
        started = time.perf_counter()
        tokens = await asyncio.gather(
            *(
                generated_tokens(engine, tokenizer, messages, params, adapters[i % count], f"r{i}")
                for i, messages in enumerate(prompts(sequences))
            )
        )
        return sum(tokens) / (time.perf_counter() - started)

    await rate(8, 4)  # warm-up: every adapter loaded
    rates: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    for _ in range(args.rounds):
        for shape in SHAPES:
            rates[shape].append(await rate(*shape))
    engine.shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="the demo's")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rates = asyncio.run(measure(args))
    medians = {shape: statistics.median(values) for shape, values in rates.items()}
    print_table(
        f"CPU engine output tokens/s ({args.threads} threads, {args.max_tokens} tokens a sample)",
        ["sequences", "adapters", "tok/s per round", "median", "vs 32 over one"],
        [
            [
                n,
                a,
                " ".join(f"{v:.0f}" for v in rates[(n, a)]),
                medians[(n, a)],
                medians[(n, a)] / medians[(32, 1)],
            ]
            for n, a in SHAPES
        ],
    )
    print_result(
        {
            "bench": "multi_lora_batch",
            "tok_s": {f"{n}x{a}": round(medians[(n, a)], 1) for n, a in SHAPES},
            "ratio_4_adapters": round(medians[(128, 4)] / medians[(32, 1)], 3),
            "ratio_1_adapter": round(medians[(128, 1)] / medians[(32, 1)], 3),
        }
    )
    os._exit(0)  # vLLM's engine finalizer raises at interpreter exit once its module globals are gone


if __name__ == "__main__":
    main()
