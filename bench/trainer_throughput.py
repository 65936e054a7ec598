"""Trained tokens per second of one GRPO step: art-ray's DeepSpeed trainer vs TRL's GRPOTrainer on the
same groups.

Both train SmolLM2-135M-Instruct with LoRA r=16 alpha=32 on q/k/v/o, lr 5e-4, no KL, on the same batch:
4 one-word-task prompts x 8 completions of 16 tokens (fixed token ids and logprobs, rewards 0/1 so every
completion has an advantage). TRL gets them through its `rollout_func`, so its step time is training,
not generation. Both use `--threads` torch threads. art-ray: median of `time/step_seconds` reported by the
trainer; TRL: median wall time of a trainer step (callbacks). The first step of each is a warm-up. art-ray
also runs on one thread (the colocated trainer's step on every core vs one core: `threads_speedup`).
Last line: {"bench": "trainer_throughput", "ratio": art-ray tokens/s / TRL tokens/s, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples" / "one_word"))

from common import print_result, print_table, start_local_ray  # noqa: E402
from tasks import TRAIN_QUESTIONS, messages_for  # noqa: E402

PROMPTS, SAMPLES, COMPLETION_TOKENS = 4, 8, 16


def batch(base_model: str) -> dict:
    """Prompt ids (chat template), completion ids, logprobs and rewards, deterministic."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    rng = random.Random(0)
    rows = []
    for question in TRAIN_QUESTIONS[:PROMPTS]:
        prompt_ids = tokenizer.apply_chat_template(messages_for(question), add_generation_prompt=True)
        if hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        for sample in range(SAMPLES):
            rows.append(
                {
                    "question": question,
                    "prompt_ids": list(prompt_ids),
                    "completion_ids": [rng.randrange(1000, 20000) for _ in range(COMPLETION_TOKENS)],
                    "logprobs": [-rng.uniform(0.5, 3.0) for _ in range(COMPLETION_TOKENS)],
                    "reward": float(sample % 2),
                }
            )
    return {"rows": rows}


def groups_from(data: dict) -> list:
    from openai.types.chat.chat_completion import Choice

    from art_ray import Trajectory, TrajectoryGroup

    groups: dict[str, list] = {}
    for row in data["rows"]:
        choice = Choice.model_validate(
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "x"},
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(row["completion_ids"], row["logprobs"], strict=True)
                    ]
                },
                "token_ids": row["completion_ids"],
                "prompt_token_ids": row["prompt_ids"],
            }
        )
        messages = messages_for(row["question"])
        groups.setdefault(row["question"], []).append(
            Trajectory(messages_and_choices=[*messages, choice], reward=row["reward"])
        )
    return [TrajectoryGroup(members) for members in groups.values()]


async def art_ray_tokens_per_second(base_model: str, data: dict, args: argparse.Namespace) -> dict:
    from art_ray import GradientStep, ModelConfig, TrainConfig
    from art_ray.adapters.spec import LoRASpec
    from art_ray.placement import Reservation
    from art_ray.trainer.config import TrainerConfig
    from art_ray.trainer.group import TrainerGroup

    start_local_ray(num_cpus=2)
    with tempfile.TemporaryDirectory() as storage:
        group = TrainerGroup(
            TrainerConfig(
                model="throughput",
                project="bench",
                base_model=base_model,
                storage=storage,
                settings=ModelConfig(lora=LoRASpec(r=16, alpha=32), sequence_length=512),
                # every core: threads pinned as the colocated trainer's are
                threads=None if args.threads == len(os.sched_getaffinity(0)) else args.threads,
                rank=Reservation(num_cpus=1),
            ),
            publish=False,
        )
        await group.start()
        groups = groups_from(data)
        seconds, tokens = [], []
        for _ in range(args.steps + 1):
            async for event in group.train(groups, TrainConfig(learning_rate=5e-4)):
                if isinstance(event, GradientStep):
                    seconds.append(event.metrics["time/step_seconds"])
                    tokens.append(event.metrics["data/trained_tokens"])
        group.shutdown()
    step = statistics.median(seconds[1:])
    return {"seconds": step, "tokens": tokens[-1], "tokens_per_second": tokens[-1] / step}


TRL_SCRIPT = r"""
import json, statistics, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

torch.set_num_threads({threads})
data = json.loads(sys.stdin.read())
rows = data["rows"]
path = {base_model!r}
tokenizer = AutoTokenizer.from_pretrained(path)
by_question = {{}}
for row in rows:
    by_question.setdefault(row["question"], []).append(row)

def rollout_func(prompts, trainer):
    out = {{"prompt_ids": [], "completion_ids": [], "logprobs": [], "bench_reward": []}}
    seen = {{}}
    for prompt in prompts:
        question = prompt[-1]["content"].rsplit(" Reply", 1)[0]
        index = seen.get(question, 0)
        members = by_question[question]
        # called with one entry per prompt or per sample: return one sample per call entry
        count = {samples} if len(prompts) == {prompts} else 1
        for row in members[index:index + count]:
            out["prompt_ids"].append(row["prompt_ids"])
            out["completion_ids"].append(row["completion_ids"])
            out["logprobs"].append(row["logprobs"])
            out["bench_reward"].append(row["reward"])
        seen[question] = index + count
    return out

def reward(completions, bench_reward, **kwargs):
    return list(bench_reward)

seconds, marks = [], {{}}

class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        marks["begin"] = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        seconds.append(time.perf_counter() - marks["begin"])

questions = list(by_question)
suffix = " Reply with exactly one word."
prompts = [{{"prompt": [{{"role": "user", "content": q + suffix}}]}} for q in questions]
dataset = Dataset.from_list(prompts * ({steps} + 1))
config = GRPOConfig(
    output_dir={out!r}, learning_rate=5e-4, per_device_train_batch_size={batch}, num_generations={samples},
    max_completion_length={completion_tokens}, beta=0.0, logging_steps=1, max_steps={steps} + 1, use_cpu=True,
    report_to="none", save_strategy="no", shuffle_dataset=False, lr_scheduler_type="constant",
    # float32 without recomputation, like art-ray's CPU trainer (TRL 1.x defaults to bf16 and gradient
    # checkpointing; this CPU has no native bf16)
    bf16=False, gradient_checkpointing=False,
)
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=reward, args=config,
    train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout_func,
    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    callbacks=[Timer()],
)
trainer.train()
print(json.dumps({{"seconds": statistics.median(seconds[1:]), "steps": len(seconds)}}))
"""


def trl_tokens_per_second(base_model: str, data: dict, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        script = TRL_SCRIPT.format(
            threads=args.threads,
            base_model=base_model,
            samples=SAMPLES,
            prompts=PROMPTS,
            steps=args.steps,
            out=out,
            batch=PROMPTS * SAMPLES,
            completion_tokens=COMPLETION_TOKENS,
        )
        completed = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps(data),
            capture_output=True,
            text=True,
            timeout=1800,
            env={"TRL_EXPERIMENTAL_SILENCE": "1", **os.environ},
        )
    if completed.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{completed.stderr[-3000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    tokens = PROMPTS * SAMPLES * COMPLETION_TOKENS
    return {"seconds": result["seconds"], "tokens": tokens, "tokens_per_second": tokens / result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from art_ray.models import resolve_base_model

    base_model = resolve_base_model("smollm2-135m")
    data = batch(base_model)
    import ray

    ours = asyncio.run(art_ray_tokens_per_second(base_model, data, args))
    ray.shutdown()
    # the colocated trainer's step on every core vs one core
    one_thread = asyncio.run(
        art_ray_tokens_per_second(base_model, data, argparse.Namespace(**{**vars(args), "threads": 1}))
    )
    ray.shutdown()
    theirs = trl_tokens_per_second(base_model, data, args)
    ratio = ours["tokens_per_second"] / theirs["tokens_per_second"]
    print_table(
        f"one GRPO step, SmolLM2-135M LoRA r=16, {PROMPTS} prompts x {SAMPLES} x {COMPLETION_TOKENS} tokens, "
        f"{args.threads} threads, median of {args.steps}",
        ["trainer", "step s", "trained tokens", "tokens/s"],
        [
            ["art-ray (DeepSpeed)", ours["seconds"], ours["tokens"], ours["tokens_per_second"]],
            ["TRL GRPOTrainer", theirs["seconds"], theirs["tokens"], theirs["tokens_per_second"]],
        ],
    )
    print_table(
        "art-ray's step on one thread vs the threads above",
        ["threads", "step s", "tokens/s", "speedup"],
        [
            [1, one_thread["seconds"], one_thread["tokens_per_second"], 1.0],
            [
                args.threads,
                ours["seconds"],
                ours["tokens_per_second"],
                one_thread["seconds"] / ours["seconds"],
            ],
        ],
    )
    print_result(
        {
            "bench": "trainer_throughput",
            "ratio": round(ratio, 3),
            "art_ray_tokens_per_second": round(ours["tokens_per_second"], 2),
            "trl_tokens_per_second": round(theirs["tokens_per_second"], 2),
            "art_ray_step_seconds": round(ours["seconds"], 3),
            "trl_step_seconds": round(theirs["seconds"], 3),
            "threads": args.threads,
            "threads_speedup": round(one_thread["seconds"] / ours["seconds"], 3),
        }
    )


if __name__ == "__main__":
    main()
