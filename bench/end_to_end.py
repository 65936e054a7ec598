"""Where a GRPO step's time goes in art-ray, and time to the one-word task's reward threshold side by side
with TRL's GRPOTrainer on the same model, task, hyperparameters and seeds.

Both: SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on q/k/v/o, lr 5e-4, 4 questions x 8 samples per step,
16 new tokens, temperature 1, the one-word task's reward (examples/one_word/tasks.py), the same question
order per seed. Time to threshold = seconds of training (model/engine start excluded, reported apart) until
a step's samples reach the mean reward `--threshold`. TRL runs in its own process with every core.
art-ray's loss is ART's default (`--policy-loss art`), which on-policy gives TRL's gradient (see
train_config); `--policy-loss ppo` uses TRL's clip.

art-ray modes (`--modes`), each on a backend of its own:
- "colocated" (the default layout on one box): engine and trainer take turns, each phase on every core;
- "split": engine and trainer keep one core each (the layout before colocation), sampling then training;
- "overlap": split, and step N+1 samples while step N trains (one step off-policy).
- "pipelined": split, with art_ray.PipelineTrainer: rollouts never wait for training, groups at most
  `--max-steps-off-policy` steps stale, `--max-batch-groups` groups per step at most.
Engine busy fraction: the share of the loop wall time spent in rollout phases, where the engine decodes.
Per seed a row; the headline is the median over seeds of art-ray's time / TRL's time.
Last line: {"bench": "end_to_end", "ratio", "ratio_colocated", "ratio_pipelined", "seeds", "busy_fraction",
"busy_fraction_pipelined", "steps_sync", "steps_pipelined", ...}.
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

from common import free_port, median, print_result, print_table  # noqa: E402
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


def train_config(args: argparse.Namespace):
    """`--policy-loss art`: ART 0.5's default loss (CISPO, the ratio a stop-gradient weight clipped to
    [0, 5]); `ppo`: the clipped ratio in [0.8, 1.2], as TRL. On-policy samples (ratio 1: the sync loops)
    get the same gradient from both; a step off-policy, PPO's clip drops the tokens whose ratio moved."""
    from art_ray import TrainConfig

    if args.policy_loss == "ppo":
        return TrainConfig(learning_rate=LEARNING_RATE)
    return TrainConfig(learning_rate=LEARNING_RATE, policy_loss="cispo", epsilon=1.0, epsilon_high=4.0)


async def train_step(model, groups: list, config) -> dict:
    started = time.perf_counter()
    await model.train(groups, config, verbose=False)
    total_s = time.perf_counter() - started
    summary = model.last_train_result.metrics
    train_s = sum(m["time/step_seconds"] for m in model.last_train_metrics)
    # the call waits for the last step's checkpoint only if it is still being written
    checkpoint_s = summary["time/checkpoint_wait_seconds"]
    publish_s = summary["time/publish_enqueue_seconds"] + summary["time/wait_for_replicas_seconds"]
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


async def run_loop(model, args: argparse.Namespace, seed: int, overlap: bool) -> dict:
    """Sampling and training steps until a step's samples reach the threshold.

    overlap=False: sample, train, sample, ... (each step samples from the newest policy).
    overlap=True: step N+1 samples while step N trains, from the policy of step N-1 (one step off-policy;
    the trainer's importance ratio uses the sampling logprobs). The engine and the trainer each keep a core.
    """
    batches = question_batches(seed, args.max_steps)
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
        pending_train = asyncio.ensure_future(train_step(model, groups, train_config(args)))
        if overlap:
            pending_rollout = asyncio.ensure_future(gather_step(model, batches[index + 1]))
        else:
            steps[-1].update(await pending_train)
            pending_train = None
            pending_rollout = asyncio.ensure_future(gather_step(model, batches[index + 1]))
        print(
            f"art-ray seed {seed} {'overlap' if overlap else 'sync'} step {len(steps)}: reward {reward:.3f}  "
            f"rollout {rollout_s:.1f} s, train {steps[-1].get('train_s', 0):.1f} s, other "
            f"{steps[-1].get('other_s', 0):.1f} s  (started {step_start - loop_start:.1f} s into the loop)",
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


async def pipelined_loop(model, args: argparse.Namespace, seed: int) -> dict:
    """art_ray.PipelineTrainer on the same questions and hyperparameters, until a step's worth of samples
    (GROUPS_PER_STEP groups) from one policy reach the threshold, as the sync loop judges its batches: at
    the moment those samples are done, and counting policy `v`'s batch as step `v + 1`. (Judging each
    train step's batch after its training, as this loop did first, lagged a train call and, its samples
    being a step off-policy, a step.)"""
    import train  # examples/one_word/train.py: the rollout the demo uses (as Ray work)

    import art_ray

    by_policy: dict[int, list[float]] = {}  # policy -> finished groups' mean rewards, in order
    reached: list[tuple[float, int]] = []  # (seconds into the loop, steps)

    async def rollout_group(model, question: str) -> art_ray.TrajectoryGroup:
        group = await art_ray.TrajectoryGroup(train.rollout(model, question) for _ in range(GROUP_SIZE))
        for trajectory in group.trajectories:
            trajectory.stamp_policy_versions()  # from the step that served each choice
        policy = min(t.initial_policy_version or 0 for t in group.trajectories)
        rewards = by_policy.setdefault(policy, [])
        rewards.append(sum(group.rewards) / len(group.rewards))
        if len(rewards) == GROUPS_PER_STEP and sum(rewards) / len(rewards) >= args.threshold and not reached:
            reached.append((time.perf_counter() - loop_start, policy + 1))
            pipeline.request_stop()
        return group

    questions = [q for batch in question_batches(seed, 10 * args.max_steps) for q in batch]
    pipeline = art_ray.PipelineTrainer(
        model,
        rollout_group,
        questions,
        train_config=train_config(args),
        num_rollout_workers=GROUPS_PER_STEP,
        min_batch_size=GROUPS_PER_STEP,
        max_batch_size=args.max_batch_groups,
        max_steps_off_policy=args.max_steps_off_policy,
        max_steps=args.max_steps,
        resume=False,
        verbose=False,
    )
    loop_start = time.perf_counter()

    async def watch() -> None:
        seen = 0
        while True:
            await asyncio.sleep(0.2)
            for report in pipeline.reports[seen:]:
                print(
                    f"art-ray seed {seed} pipelined step {report.step}: reward {report.reward:.3f}  "
                    f"groups {report.groups}, off-policy {report.steps_off_policy_mean:.2f}/"
                    f"{report.steps_off_policy_max}, stale {report.groups_dropped_stale}, engine busy "
                    f"{report.engine_busy:.2f}, trainer busy {report.trainer_busy:.2f}, "
                    f"{report.seconds:.1f} s",
                    flush=True,
                )
            seen = len(pipeline.reports)

    watcher = asyncio.ensure_future(watch())
    reports = await pipeline.train()
    await asyncio.sleep(0.3)
    watcher.cancel()
    loop_s = time.perf_counter() - loop_start
    steps = [
        {
            "reward": r.reward,
            "rollout_s": r.engine_busy * r.seconds,
            "train_s": r.trainer_busy * r.seconds,
            "checkpoint_s": 0.0,
            "publish_s": 0.0,
            "other_s": 0.0,
            "steps_off_policy": r.steps_off_policy_mean,
            "stale": r.groups_dropped_stale,
        }
        for r in reports
    ]
    engine_s = sum(r.engine_busy * r.seconds for r in reports)
    return {
        "seconds_to_threshold": reached[0][0] if reached else None,
        "steps_to_threshold": reached[0][1] if reached else len(reports) + 1,
        "loop_s": loop_s,
        "steps": steps,
        "busy_fraction": engine_s / max(loop_s, 1e-9),
    }


def mode_config(mode: str):
    from art_ray import LoRASpec, ModelConfig

    layout = "colocated" if mode == "colocated" else "split"  # pipelined: the split layout's loop
    # split: one core each, as the engine and the trainer held before colocation
    threads = None if layout == "colocated" else 1
    return ModelConfig(
        lora=LoRASpec(r=16, alpha=32),
        sequence_length=256,
        max_model_len=512,
        layout=layout,
        engine_threads=threads,
        trainer_threads=threads,
    )


async def art_ray_run(args: argparse.Namespace, mode: str, storage: str) -> dict[int, dict]:
    """One backend (engine start paid once) and one model per seed; returns seed -> run."""
    from art_ray import RayBackend, TrainableModel

    start = time.perf_counter()
    backend = RayBackend(storage=storage, port=free_port())
    runs: dict[int, dict] = {}
    try:
        for seed in args.seeds:
            model = TrainableModel(
                name=f"bench-{mode}-{seed}",
                project="bench",
                base_model="smollm2-135m",
                config=mode_config(mode),
            )
            model.config.seed = seed
            await model.register(backend)
            startup = time.perf_counter() - start
            if mode == "pipelined":
                runs[seed] = await pipelined_loop(model, args, seed)
            else:
                runs[seed] = await run_loop(model, args, seed, overlap=mode == "overlap")
            runs[seed]["startup_s"] = startup
            backend.stop_trainers()  # the next seed's trainer takes its place
            start = time.perf_counter()
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
    # art-ray's CPU trainer runs float32 without recomputation; TRL 1.x defaults to bf16 and gradient
    # checkpointing, which on this CPU (no native bf16) made each of its steps minutes long.
    bf16=False, gradient_checkpointing=False,
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


def trl_run(args: argparse.Namespace, seed: int, workdir: str) -> dict:
    script = TRL_SCRIPT.format(
        tasks_dir=str(ROOT / "examples" / "one_word"),
        batches=question_batches(seed, args.max_steps),
        threshold=args.threshold,
        out=workdir,
        lr=LEARNING_RATE,
        max_steps=args.max_steps,
        seed=seed,
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=args.max_steps * 300
    )
    if completed.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{completed.stderr[-3000:]}")
    for line in completed.stdout.splitlines():
        if line.startswith("TRL step"):
            print(f"seed {seed}: {line}", flush=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def summarize(run: dict) -> dict:
    phases = ("rollout_s", "train_s", "checkpoint_s", "publish_s", "other_s")
    trained = [s for s in run["steps"] if "train_s" in s]
    run["mean"] = {key: sum(s[key] for s in trained) / max(1, len(trained)) for key in phases}
    run["seconds_per_step"] = run["loop_s"] / len(run["steps"])
    # batches sampled until one reached the threshold (the sync loop samples one batch per step)
    run.setdefault("steps_to_threshold", len(run["steps"]))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threshold", type=float, default=0.8, help="mean reward of a step's samples")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[0, 1, 2])
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=["colocated", "pipelined"],
        help="art-ray loops to run (colocated, pipelined, split, overlap); the first is the headline",
    )
    parser.add_argument("--max-steps-off-policy", type=int, default=1, help="pipelined mode's bound")
    parser.add_argument(
        "--policy-loss", choices=["art", "ppo"], default="art", help="art-ray's loss (see train_config)"
    )
    parser.add_argument("--max-batch-groups", type=int, default=GROUPS_PER_STEP, help="pipelined mode")
    parser.add_argument("--stall-seconds", type=float, default=180, help="print the loop's tasks after")
    args = parser.parse_args()
    ours: dict[str, dict[int, dict]] = {}
    theirs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.modes:
            ours[mode] = {
                seed: summarize(run)
                for seed, run in asyncio.run(art_ray_run(args, mode, f"{workdir}/art_ray-{mode}")).items()
            }
        if not args.skip_trl:
            theirs = {seed: trl_run(args, seed, f"{workdir}/trl-{seed}") for seed in args.seeds}

    phases = ("rollout_s", "train_s", "checkpoint_s", "publish_s", "other_s")
    print_table(
        "art-ray: seconds per trained step (mean over the run; checkpoint = seconds the step waited for it)",
        ["mode", "seed", "rollout", "train", "checkpoint", "publish", "other", "wall/step", "engine busy"],
        [
            [mode, seed, *(run["mean"][k] for k in phases), run["seconds_per_step"], run["busy_fraction"]]
            for mode, runs in ours.items()
            for seed, run in runs.items()
        ],
    )
    rows = []
    ratios: dict[str, list[float]] = {mode: [] for mode in ours}
    for seed in args.seeds:
        trl = theirs.get(seed)
        trl_s = trl["seconds_to_threshold"] if trl else None
        for mode, runs in ours.items():
            run = runs[seed]
            ours_s = run["seconds_to_threshold"]
            ratio = round(ours_s / trl_s, 3) if ours_s and trl_s else None
            if ratio is not None:
                ratios[mode].append(ratio)
            steps = run["steps_to_threshold"]
            rows.append(
                [f"art-ray ({mode})", seed, run["startup_s"], steps, run["seconds_per_step"], ours_s, ratio]
            )
        if trl:
            steps = trl["steps"]
            per_step = sum(s["seconds"] for s in steps) / max(1, len(steps))
            rows.append(["TRL GRPOTrainer", seed, trl["startup_s"], len(steps), per_step, trl_s, 1.0])
    print_table(
        f"time to a step reward >= {args.threshold} (seconds of training; start-up apart)",
        ["system", "seed", "start-up s", "steps", "s/step", "seconds to threshold", "ratio to TRL"],
        [[value if value is not None else "not reached" for value in row] for row in rows],
    )
    headline = args.modes[0]
    runs = ours[headline]

    def med(values: list[float]) -> float | None:
        return round(median(values), 3) if values else None

    result = {
        "bench": "end_to_end",
        "threshold": args.threshold,
        "mode": headline,
        "seeds": args.seeds,
        "ratio": med(ratios[headline]) if len(ratios[headline]) == len(args.seeds) else None,
        **{f"ratio_{m}": med(v) if len(v) == len(args.seeds) else None for m, v in ratios.items()},
        "art_ray_seconds": med([r["seconds_to_threshold"] or float("inf") for r in runs.values()]),
        "trl_seconds": med([t["seconds_to_threshold"] or float("inf") for t in theirs.values()] or [0]),
        "art_ray_steps": med([r["steps_to_threshold"] for r in runs.values()]),
        "trl_steps": med([len(t["steps"]) for t in theirs.values()]) if theirs else None,
        "busy_fraction": med([r["busy_fraction"] for r in runs.values()]),
        **{f"busy_fraction_{m}": med([r["busy_fraction"] for r in v.values()]) for m, v in ours.items()},
        **{
            f"steps_{'sync' if m == 'colocated' else m}": med([r["steps_to_threshold"] for r in v.values()])
            for m, v in ours.items()
        },
        "art_ray_seconds_per_step": med([r["seconds_per_step"] for r in runs.values()]),
        **{f"art_ray_{k}": med([r["mean"][k] for r in runs.values()]) for k in phases},
    }
    print_result(result)


if __name__ == "__main__":
    main()
