"""Where a GRPO step's time goes in art-ray, and time to the one-word task's reward threshold side by side
with TRL's GRPOTrainer on the same model, task and hyperparameters.

Both: SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on q/k/v/o, lr 5e-4, 4 questions x 8 samples per step,
16 new tokens, temperature 1, the one-word task's reward (examples/one_word/tasks.py), the same question
order. Time to threshold = seconds of training (model/engine start excluded, reported apart) until a
step's samples reach the mean reward `--threshold`. art-ray runs as the demo does (vLLM engine and
DeepSpeed trainer with one thread each); TRL runs in its own process with both cores.

Engine busy fraction: the share of art-ray's loop wall time spent in rollout phases, where the engine
decodes (the loop is synchronous: sampling, then training, then publishing).
Last line: {"bench": "end_to_end", "ratio": art-ray time / TRL time, "busy_fraction": ..., ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples" / "one_word"))

from common import free_port, print_result, print_table  # noqa: E402
from tasks import TRAIN_QUESTIONS  # noqa: E402

LEARNING_RATE = 5e-4
GROUPS_PER_STEP, GROUP_SIZE, MAX_TOKENS = 4, 8, 16


def question_batches(seed: int, steps: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [rng.sample(TRAIN_QUESTIONS, GROUPS_PER_STEP) for _ in range(steps)]


async def art_ray_run(args: argparse.Namespace, storage: str) -> dict:
    import train  # examples/one_word/train.py: the rollout the demo uses (as Ray work)

    import art_ray
    from art_ray import LoRASpec, ModelConfig, RayBackend, TrainableModel, TrainConfig

    start = time.perf_counter()
    backend = RayBackend(storage=storage, port=free_port())
    model = TrainableModel(
        name="bench",
        project="bench",
        base_model="smollm2-135m",
        config=ModelConfig(lora=LoRASpec(r=16, alpha=32), sequence_length=256, max_model_len=512),
    )
    steps: list[dict] = []
    try:
        await model.register(backend)
        startup = time.perf_counter() - start
        loop_start = time.perf_counter()
        reached = None
        for questions in question_batches(args.seed, args.max_steps):
            phase = time.perf_counter()
            groups = await art_ray.gather_trajectory_groups(
                (
                    art_ray.TrajectoryGroup(train.rollout(model, q) for _ in range(GROUP_SIZE))
                    for q in questions
                ),
                pbar_desc=None,
            )
            rollout_s = time.perf_counter() - phase
            reward = sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups)
            phase = time.perf_counter()
            await model.train(groups, TrainConfig(learning_rate=LEARNING_RATE), verbose=False)
            total_s = time.perf_counter() - phase
            summary = model.last_train_summary
            train_s = sum(m["time/step_seconds"] for m in model.last_train_metrics)
            steps.append(
                {
                    "reward": reward,
                    "rollout_s": rollout_s,
                    "train_s": train_s,
                    "checkpoint_s": summary["time/checkpoint_seconds"],
                    "publish_s": summary["time/publish_seconds"],
                    "other_s": total_s
                    - train_s
                    - summary["time/checkpoint_seconds"]
                    - summary["time/publish_seconds"],
                }
            )
            print(f"art-ray step {len(steps)}: reward {reward:.3f}  {rollout_s + total_s:.1f} s", flush=True)
            if reward >= args.threshold:
                reached = time.perf_counter() - loop_start
                break
        loop_s = time.perf_counter() - loop_start
    finally:
        backend.shutdown()
    return {
        "startup_s": startup,
        "seconds_to_threshold": reached,
        "steps": steps,
        "busy_fraction": sum(s["rollout_s"] for s in steps) / loop_s,
    }


TRL_SCRIPT = r"""
import json, random, sys, time
sys.path.insert(0, {tasks_dir!r})
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from tasks import TRAIN_QUESTIONS, messages_for, one_word_reward
from art_ray.models import resolve_base_model

torch.set_num_threads(2)
start = time.perf_counter()
path = resolve_base_model("smollm2-135m")
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
batches = {batches!r}
prompts = [{{"prompt": messages_for(q)}} for batch in batches for q in batch]

def reward(completions, completion_ids, **kwargs):
    out = []
    for completion, ids in zip(completions, completion_ids):
        finish = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
        out.append(one_word_reward(completion[0]["content"], finish))
    return out

steps, marks = [], {{}}

class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        marks["begin"] = time.perf_counter()
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            steps.append({{"reward": logs["reward"], "seconds": time.perf_counter() - marks["begin"]}})
            print("TRL step", len(steps), "reward", round(logs["reward"], 3), flush=True)
            if logs["reward"] >= {threshold}:
                control.should_training_stop = True

config = GRPOConfig(
    output_dir={out!r}, learning_rate={lr}, per_device_train_batch_size=32, num_generations=8,
    max_completion_length=16, temperature=1.0, beta=0.0, logging_steps=1, max_steps={max_steps},
    use_cpu=True, report_to="none", save_strategy="no", shuffle_dataset=False, seed={seed},
    lr_scheduler_type="constant",
)
trainer = GRPOTrainer(
    model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(prompts),
    processing_class=tokenizer,
    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    callbacks=[Timer()],
)
startup = time.perf_counter() - start
loop_start = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - loop_start
reached = seconds if steps and steps[-1]["reward"] >= {threshold} else None
print(json.dumps({{"startup_s": startup, "seconds_to_threshold": reached, "steps": steps}}))
"""


def trl_run(args: argparse.Namespace, workdir: str) -> dict:
    script = TRL_SCRIPT.format(
        tasks_dir=str(ROOT / "examples" / "one_word"),
        batches=question_batches(args.seed, args.max_steps),
        threshold=args.threshold,
        out=workdir,
        lr=LEARNING_RATE,
        max_steps=args.max_steps,
        seed=args.seed,
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=args.max_steps * 300
    )
    if completed.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{completed.stderr[-3000:]}")
    for line in completed.stdout.splitlines():
        if line.startswith("TRL step"):
            print(line, flush=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threshold", type=float, default=0.8, help="mean reward of a step's samples")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        ours = asyncio.run(art_ray_run(args, f"{workdir}/art_ray"))
        theirs = None if args.skip_trl else trl_run(args, f"{workdir}/trl")

    steps = ours["steps"]
    mean = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0] if key != "reward"}
    print_table(
        "art-ray: seconds per step (mean over the run)",
        ["rollout", "train", "checkpoint", "publish", "other", "total", "engine busy"],
        [
            [
                *(mean[k] for k in ("rollout_s", "train_s", "checkpoint_s", "publish_s", "other_s")),
                sum(mean.values()),
                ours["busy_fraction"],
            ]
        ],
    )
    rows = [
        [
            "art-ray",
            ours["startup_s"],
            len(steps),
            sum(sum(s.values()) - s["reward"] for s in steps) / len(steps),
            steps[-1]["reward"],
            ours["seconds_to_threshold"],
        ]
    ]
    result = {
        "bench": "end_to_end",
        "threshold": args.threshold,
        "art_ray_seconds": ours["seconds_to_threshold"],
        "art_ray_steps": len(steps),
        "busy_fraction": round(ours["busy_fraction"], 3),
        **{f"art_ray_{k}": round(v, 2) for k, v in mean.items()},
    }
    if theirs is not None:
        trl_steps = theirs["steps"]
        rows.append(
            [
                "TRL GRPOTrainer",
                theirs["startup_s"],
                len(trl_steps),
                sum(s["seconds"] for s in trl_steps) / max(1, len(trl_steps)),
                trl_steps[-1]["reward"] if trl_steps else float("nan"),
                theirs["seconds_to_threshold"],
            ]
        )
        result["trl_seconds"] = theirs["seconds_to_threshold"]
        result["trl_steps"] = len(trl_steps)
        if ours["seconds_to_threshold"] and theirs["seconds_to_threshold"]:
            result["ratio"] = round(ours["seconds_to_threshold"] / theirs["seconds_to_threshold"], 3)
        else:
            result["ratio"] = None
    print_table(
        f"time to a step reward >= {args.threshold} (seconds of training; start-up apart)",
        ["system", "start-up s", "steps", "s/step", "last reward", "seconds to threshold"],
        [[value if value is not None else "not reached" for value in row] for row in rows],
    )
    print_result(result)


if __name__ == "__main__":
    main()
