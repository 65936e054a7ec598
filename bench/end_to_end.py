"""Where a GRPO step's time goes in art-ray, and time to the one-word task's reward threshold side by side
with TRL's GRPOTrainer on the same model, task and hyperparameters.

Both: SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on q/k/v/o, lr 5e-4, 4 questions x 8 samples per step,
16 new tokens, temperature 1, the one-word task's reward (examples/one_word/tasks.py), the same question
order. Time to threshold = seconds of training (model/engine start excluded, reported apart) until a
step's samples reach the mean reward `--threshold`. art-ray runs as the demo does (vLLM engine and
DeepSpeed trainer with one thread each); TRL runs in its own process with both cores.

Engine busy fraction: the share of the loop wall time spent in rollout phases, where the engine decodes.
Two loops (`--modes`): "sync" samples, trains, publishes, samples again; "overlap" samples step N+1
while step N trains (one step off-policy, corrected by the importance ratio on the sampling logprobs).
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


async def gather_step(model, questions: list[str]) -> tuple[list, float]:
    import train  # examples/one_word/train.py: the rollout the demo uses (as Ray work)

    import art_ray

    started = time.perf_counter()
    groups = await art_ray.gather_trajectory_groups(
        (art_ray.TrajectoryGroup(train.rollout(model, q) for _ in range(GROUP_SIZE)) for q in questions),
        pbar_desc=None,
    )
    return groups, time.perf_counter() - started


async def train_step(model, groups: list) -> dict:
    from art_ray import TrainConfig

    started = time.perf_counter()
    await model.train(groups, TrainConfig(learning_rate=LEARNING_RATE), verbose=False)
    total_s = time.perf_counter() - started
    summary = model.last_train_summary
    train_s = sum(m["time/step_seconds"] for m in model.last_train_metrics)
    checkpoint_s, publish_s = summary["time/checkpoint_seconds"], summary["time/publish_seconds"]
    return {
        "train_s": train_s,
        "checkpoint_s": checkpoint_s,
        "publish_s": publish_s,
        "other_s": total_s - train_s - checkpoint_s - publish_s,
    }


async def dump_stacks_when_stalled(progress: list[float], stall_seconds: float) -> None:
    """A loop that makes no progress for `stall_seconds` prints where each of its tasks waits."""
    while True:
        await asyncio.sleep(10)
        if time.perf_counter() - progress[0] > stall_seconds:
            print(f"no progress for {stall_seconds:.0f} s; the driver's tasks:", file=sys.stderr, flush=True)
            for task in asyncio.all_tasks():
                task.print_stack(file=sys.stderr)
            progress[0] = time.perf_counter()


async def run_loop(model, args: argparse.Namespace, overlap: bool) -> dict:
    """Sampling and training steps until a step's samples reach the threshold.

    overlap=False: sample, train, sample, ... (each step samples from the newest policy).
    overlap=True: step N+1 samples while step N trains, from the policy of step N-1 (one step off-policy;
    the trainer's importance ratio uses the sampling logprobs). The engine and the trainer each keep a core.
    """
    batches = question_batches(args.seed, args.max_steps)
    steps: list[dict] = []
    reached = None
    loop_start = time.perf_counter()
    progress = [loop_start]
    watchdog = asyncio.ensure_future(dump_stacks_when_stalled(progress, args.stall_seconds))
    pending_rollout = asyncio.ensure_future(gather_step(model, batches[0]))
    pending_train: asyncio.Future | None = None
    for index in range(len(batches)):
        step_start = time.perf_counter()
        groups, rollout_s = await pending_rollout
        reward = sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups)
        if pending_train is not None:
            steps[-1].update(await pending_train)
        steps.append({"reward": reward, "rollout_s": rollout_s})
        progress[0] = time.perf_counter()
        if reward >= args.threshold:
            reached = time.perf_counter() - loop_start
            break
        if index + 1 == len(batches):
            break
        pending_train = asyncio.ensure_future(train_step(model, groups))
        if overlap:
            pending_rollout = asyncio.ensure_future(gather_step(model, batches[index + 1]))
        else:
            steps[-1].update(await pending_train)
            pending_train = None
            pending_rollout = asyncio.ensure_future(gather_step(model, batches[index + 1]))
        print(
            f"art-ray {'overlap' if overlap else 'sync'} step {len(steps)}: reward {reward:.3f}  "
            f"rollout {rollout_s:.1f} s  (step started {step_start - loop_start:.1f} s into the loop)",
            flush=True,
        )
    loop_s = time.perf_counter() - loop_start
    if pending_train is not None:
        await pending_train
    watchdog.cancel()
    return {
        "seconds_to_threshold": reached,
        "loop_s": loop_s,
        "steps": steps,
        # rollouts never overlap each other, so their sum is the engine's busy time
        "busy_fraction": sum(s["rollout_s"] for s in steps) / loop_s,
    }


async def art_ray_run(args: argparse.Namespace, storage: str) -> dict[str, dict]:
    from art_ray import LoRASpec, ModelConfig, RayBackend, TrainableModel

    start = time.perf_counter()
    backend = RayBackend(storage=storage, port=free_port())
    runs: dict[str, dict] = {}
    try:
        for mode in args.modes:
            model = TrainableModel(
                name=f"bench-{mode}",
                project="bench",
                base_model="smollm2-135m",
                config=ModelConfig(
                    lora=LoRASpec(r=16, alpha=32),
                    sequence_length=256,
                    max_model_len=512,
                    engine_threads=args.engine_threads,
                    trainer_threads=args.trainer_threads,
                ),
            )
            await model.register(backend)
            if not runs:
                startup = time.perf_counter() - start
            runs[mode] = await run_loop(model, args, overlap=mode == "overlap")
            runs[mode]["startup_s"] = startup
    finally:
        backend.shutdown()
    return runs


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
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=["sync", "overlap"],
        help="art-ray loops to run, in order; the first is the headline (and pays the runner start)",
    )
    parser.add_argument("--stall-seconds", type=float, default=180, help="print the loop's tasks after")
    parser.add_argument("--engine-threads", type=int, default=1, help="the vLLM engine's torch threads")
    parser.add_argument("--trainer-threads", type=int, default=1, help="the trainer's torch threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        ours = asyncio.run(art_ray_run(args, f"{workdir}/art_ray"))
        theirs = None if args.skip_trl else trl_run(args, f"{workdir}/trl")

    phases = ("rollout_s", "train_s", "checkpoint_s", "publish_s", "other_s")
    breakdown, rows = [], []
    for mode, run in ours.items():
        trained = [s for s in run["steps"] if "train_s" in s]
        mean = {key: sum(s[key] for s in trained) / max(1, len(trained)) for key in phases}
        run["mean"] = mean
        run["seconds_per_step"] = run["loop_s"] / len(run["steps"])
        breakdown.append([mode, *(mean[k] for k in phases), run["seconds_per_step"], run["busy_fraction"]])
        rows.append(
            [
                f"art-ray ({mode})",
                run["startup_s"],
                len(run["steps"]),
                run["seconds_per_step"],
                run["steps"][-1]["reward"],
                run["seconds_to_threshold"],
            ]
        )
    print_table(
        "art-ray: seconds per trained step (mean; wall per step includes overlap)",
        ["loop", "rollout", "train", "checkpoint", "publish", "other", "wall/step", "engine busy"],
        breakdown,
    )
    headline_mode = args.modes[0]
    headline = ours[headline_mode]
    result = {
        "bench": "end_to_end",
        "threshold": args.threshold,
        "mode": headline_mode,
        "art_ray_seconds": headline["seconds_to_threshold"],
        "art_ray_steps": len(headline["steps"]),
        "busy_fraction": round(headline["busy_fraction"], 3),
        "art_ray_seconds_per_step": round(headline["seconds_per_step"], 2),
        **{f"art_ray_{k}": round(v, 2) for k, v in headline["mean"].items()},
        **{
            f"{mode}_seconds": run["seconds_to_threshold"]
            for mode, run in ours.items()
            if mode != headline_mode
        },
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
        for mode, run in ours.items():
            key = "ratio" if mode == headline_mode else f"ratio_{mode}"
            ours_s, theirs_s = run["seconds_to_threshold"], theirs["seconds_to_threshold"]
            result[key] = round(ours_s / theirs_s, 3) if ours_s and theirs_s else None
    print_table(
        f"time to a step reward >= {args.threshold} (seconds of training; start-up apart)",
        ["system", "start-up s", "steps", "s/step", "last reward", "seconds to threshold"],
        [[value if value is not None else "not reached" for value in row] for row in rows],
    )
    print_result(result)


if __name__ == "__main__":
    main()
