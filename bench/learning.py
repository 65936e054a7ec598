"""Learning curves: greedy held-out correctness against minutes of training, art-ray on the code_math and
email agent examples, and TRL's GRPOTrainer on code_math, for each seed.

Each art-ray run registers a fresh model (the base model, LoRA from scratch) on one shared backend and
trains with the example's own rollout and settings (examples/loop.py's defaults, or the flags below),
one GRPO step after another, until `--minutes` of rollout and training time; evaluation is not counted
(reported apart). Held-out: the first `--held-out` items of each example's held-out set
(problems.held_out_problems, inbox.held_out_scenarios), the same for every seed and system, evaluated
before training and every `--eval-every` training minutes; each figure has its 95% Wilson interval.
The held-out curve goes to MLflow beside the reward (val/correct at each step). TRL (bench/trl_code_math.py)
gets the same model, prompt, reward, problems, group size, learning rate, LoRA and budget, in its own
process with every core.

Headline per task: the median over seeds of the final held-out correctness, and its lift over the base
model. Against TRL, per seed: the training minutes art-ray's run takes to reach the final (and the best)
correctness of TRL's run, divided by the minutes TRL took to first reach it (no ratio where TRL's run is
there at minute 0, i.e. never rose above its start); the headline is the median over seeds.
The PNG (`--plot`): correctness against training minutes, a thin line per seed and system, the medians bold;
beside it a JSON file with every run's evaluations.

    python bench/learning.py                      # 15 minutes x seeds 0,1,2 x both tasks, and TRL
    python bench/learning.py --short              # one seed, 2 minutes, the tiny model: does it run

Last line: {"bench": "learning", "minutes", "seeds", "<task>_base", "<task>_final", "<task>_lift",
"<task>_final_ci", "trl_final", "trl_lift", "minutes_to_trl_final", "ratio_to_trl", "trl_best",
"minutes_to_trl_best", "ratio_to_trl_best", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples"))

from common import box_gflops, free_port, print_result, print_table  # noqa: E402

if TYPE_CHECKING:
    from art_ray.train_config import TrainConfig

HELD_OUT = {"code_math": 128, "email_agent": 64, "terminal_agent": 64}
# `--trained-at`'s arms beside the example's own recipe: each choice trained at the temperature it was sampled
# at, or as if sampled at 1 (how every version before issue 46 trained): the system's name in the table and
# its headline keys' prefix after the task's name
ARMS = {"tempered": ("art-ray (tempered)", "_tempered"), "one": ("art-ray (as if T=1)", "_as_if_t1")}
# held-out evaluations of the email agent are multi-turn and cost more: fewer of them
EVAL_EVERY = {"code_math": 1.5, "email_agent": 3.0, "terminal_agent": 3.0}


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def load_example(task: str) -> ModuleType:
    """examples/<task>/train.py as module `<task>_train`, pickled by value into Ray work: the two examples'
    scripts share the file name `train.py`, so neither is importable by that name on the workers. Their
    helpers (problems.py, execute.py, inbox.py) import there from the examples' folders, which the workers
    of a backend started after this import have on their path."""
    import ray

    spec = importlib.util.spec_from_file_location(f"{task}_train", ROOT / "examples" / task / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def held_out_items(task: str, count: int) -> list:
    if task == "code_math":
        from problems import held_out_problems

        return held_out_problems(count)
    if task == "terminal_agent":
        from repos import held_out_repos

        return held_out_repos(count)
    from inbox import held_out_scenarios

    return held_out_scenarios(count)


def settings(task, args: argparse.Namespace) -> argparse.Namespace:  # noqa: ANN001
    """The example's own defaults (examples/loop.py), with this bench's flags where given."""
    from loop import parse_args

    defaults = parse_args(task.name, "", ["--model", args.model])
    for key in ("learning_rate", "groups_per_step", "group_size", "lora_rank"):
        if getattr(args, key) is not None:
            setattr(defaults, key, getattr(args, key))
    update: dict = {"learning_rate": defaults.learning_rate}
    if args.scale_rewards is not None:
        update["scale_rewards"] = args.scale_rewards == "group"
    if args.num_gradient_steps is not None:
        update["num_gradient_steps"] = args.num_gradient_steps
    if args.precalculate_logprobs is not None:
        update["precalculate_logprobs"] = args.precalculate_logprobs == "on"
    if args.max_grad_norm is not None:
        update["max_grad_norm"] = args.max_grad_norm
    if args.beta is not None:
        update["beta"] = args.beta
    defaults.train_config = task.train_config.model_copy(update=update)
    return defaults


def arm_train_config(config: TrainConfig, arm: str | None, args: argparse.Namespace) -> TrainConfig:
    """An arm's recipe: the example's own (None); every choice trained at the temperature it was sampled at
    ("tempered"); or as if sampled at 1 ("one", as ART trains), its old logprobs precalculated by the trainer
    so the ratio still starts at 1, with `--as-if-t1-beta`'s KL penalty where given."""
    if arm == "tempered":
        return config.model_copy(update={"train_temperature": None})
    if arm == "one":
        update: dict = {"precalculate_logprobs": True, "train_temperature": 1.0}
        if args.as_if_t1_beta is not None:
            update["beta"] = args.as_if_t1_beta
        return config.model_copy(update=update)
    return config


async def art_ray_curve(  # noqa: ANN001
    backend, task, seed: int, args: argparse.Namespace, arm: str | None = None
) -> dict:
    """One fresh model trained for the budget; held-out correctness at each evaluation. `arm`: the
    example's own recipe (None) or one of ARMS (`arm_train_config`; evaluation is greedy either way)."""
    import random

    from loop import evaluate, gather_and_train, task_model_config

    from art_ray import TrainableModel

    run = settings(task, args)
    run.train_config = arm_train_config(run.train_config, arm, args)
    system, suffix = ARMS[arm] if arm else ("art-ray", "")
    model = TrainableModel(
        name=run_name(task, seed) + suffix.replace("_", "-"),
        project="bench-learning",
        base_model=args.model,
        config=task_model_config(task, run.lora_rank, seed=seed),
    )
    await model.register(backend)
    points: list[dict] = []
    eval_s = 0.0

    async def held_out(train_s: float) -> None:
        nonlocal eval_s
        started = time.perf_counter()
        group = await evaluate(task, model)
        correct = sum(t.metrics.get("correct", 0.0) for t in group)
        n = len(task.val_scenarios)
        low, high = wilson(correct, n)
        step = await model.get_step()
        await model.log(
            [group], split="val", metrics={"val/correct_ci_low": low, "val/correct_ci_high": high}
        )
        eval_s += time.perf_counter() - started
        points.append({"minutes": train_s / 60, "step": step, "correct": correct / n, "n": n})
        print(
            f"art-ray {task.name} seed {seed} step {step}: {train_s / 60:.2f} min, "
            f"correct {correct / n:.3f} [{low:.3f}, {high:.3f}]",
            flush=True,
        )

    rng = random.Random(seed)
    train_s, next_eval, budget = 0.0, task_eval_every(task, args) * 60, args.minutes * 60
    rewards: list[float] = []
    await held_out(0.0)
    while train_s < budget:
        started = time.perf_counter()
        groups = await gather_and_train(
            task, model, rng, run.groups_per_step, run.group_size, run.train_config
        )
        train_s += time.perf_counter() - started
        rewards.append(statistics.fmean(t.reward for g in groups for t in g))
        if train_s >= budget or train_s >= next_eval:
            await held_out(train_s)
            while next_eval <= train_s:
                next_eval += task_eval_every(task, args) * 60
    steps = await model.get_step()
    return {
        "name": model.name,
        "system": system,
        "task": task.name,
        "seed": seed,
        "steps": steps,
        "beta": run.train_config.beta,
        "learning_rate": run.train_config.learning_rate,
        "seconds_per_step": train_s / max(1, steps),
        "eval_s": eval_s,
        "sample_rewards": rewards,
        "points": points,
    }


def run_name(task, seed: int) -> str:  # noqa: ANN001
    return f"learning-{task.name.replace('_', '-')}-{seed}"


def task_eval_every(task, args: argparse.Namespace) -> float:  # noqa: ANN001
    return args.eval_every if args.eval_every is not None else EVAL_EVERY[task.name]


def bench_tasks(args: argparse.Namespace) -> list:
    """The examples' tasks, each with this bench's held-out set."""
    return [
        dataclasses.replace(
            load_example(name).TASK, val_scenarios=held_out_items(name, args.held_out or HELD_OUT[name])
        )
        for name in args.tasks
    ]


async def art_ray_runs(
    args: argparse.Namespace,
    tasks: list,
    backend,
    free_trainer: Callable[[str], None],  # noqa: ANN001
) -> list[dict]:
    """Every task, seed and arm on one backend (the engine starts once); each run's trainer is freed after
    it. The arms of a seed run one after the other, so a change in the box's speed meets both."""
    arms = {"recipe": [None], "tempered": ["tempered"], "one": ["one"], "both": ["tempered", "one"]}[
        args.trained_at
    ]
    runs = []
    for task in tasks:
        for seed in args.seeds:
            for arm in arms:
                started = time.perf_counter()
                run = await art_ray_curve(backend, task, seed, args, arm=arm)
                run["wall_s"] = time.perf_counter() - started
                runs.append(run)
                free_trainer(run["name"])  # the next run's trainer takes its place
    print(f"MLflow: {backend.tracking_uri} (experiment bench-learning)", flush=True)
    return runs


def trl_curve(args: argparse.Namespace, seed: int, workdir: str, code_math) -> dict:  # noqa: ANN001
    run = settings(code_math, args)
    command = [
        sys.executable,
        str(Path(__file__).parent / "trl_code_math.py"),
        *("--model", args.model, "--seed", str(seed), "--minutes", str(args.minutes)),
        *("--eval-every", str(task_eval_every(code_math, args))),
        *("--held-out", str(args.held_out or HELD_OUT["code_math"])),
        *("--learning-rate", str(run.learning_rate), "--lora-rank", str(run.lora_rank)),
        *("--groups-per-step", str(run.groups_per_step), "--group-size", str(run.group_size)),
        *("--temperature", str(code_math.train_temperature), "--output-dir", f"{workdir}/trl-{seed}"),
        *("--scale-rewards", "group" if run.train_config.scale_rewards else "none"),
        *("--steps-per-generation", str(run.train_config.num_gradient_steps)),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        if line.startswith("TRL"):
            print(line, end="", flush=True)
        last = line
    if process.wait() != 0:
        raise RuntimeError(f"TRL run for seed {seed} failed (exit {process.returncode}); its stderr is above")
    result = json.loads(last)
    result["task"] = "code_math"
    return result


def first_minutes_at(points: list[dict], target: float) -> float | None:
    return next((p["minutes"] for p in points if p["correct"] >= target - 1e-9), None)


def _best(points: list[dict]) -> float:
    return max(p["correct"] for p in points)


def median_curve(runs: list[dict]) -> tuple[list[float], list[float]]:
    """The median over seeds at each evaluation index the runs share."""
    length = min(len(r["points"]) for r in runs)
    minutes = [statistics.median(r["points"][i]["minutes"] for r in runs) for i in range(length)]
    correct = [statistics.median(r["points"][i]["correct"] for r in runs) for i in range(length)]
    return minutes, correct


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = sorted({(r["system"], r["task"]) for r in runs})
    colours = dict(
        zip(
            curves,
            ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"],
            strict=False,
        )
    )
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=100)
    for key in curves:
        group = [r for r in runs if (r["system"], r["task"]) == key]
        for run in group:
            xs = [p["minutes"] for p in run["points"]]
            axes.plot(xs, [p["correct"] for p in run["points"]], color=colours[key], alpha=0.35, linewidth=1)
        xs, ys = median_curve(group)
        axes.plot(xs, ys, color=colours[key], linewidth=2.6, label=f"{key[0]} {key[1]} (median)")
    axes.set_xlabel("training minutes (rollouts + training; evaluation not counted)")
    axes.set_ylabel("held-out correctness (greedy)")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=None, help="training minutes per run (15)")
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=None)
    parser.add_argument("--tasks", type=lambda text: text.split(","), default=None)
    parser.add_argument("--model", default=None, help="smollm2-135m (the short form: tiny)")
    parser.add_argument("--held-out", type=int, default=None, help="items per task (default 128 / 64)")
    parser.add_argument("--eval-every", type=float, default=None, help="training minutes between evaluations")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the examples' own")
    parser.add_argument("--groups-per-step", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument(
        "--scale-rewards",
        choices=["group", "none"],
        default=None,
        help="advantages divided by the group's reward std (GRPO) or only centred (Dr. GRPO), both systems "
        "(default: the example's own)",
    )
    parser.add_argument(
        "--num-gradient-steps",
        type=int,
        default=None,
        help="optimizer steps per train call (TRL: steps_per_generation; default: the example's)",
    )
    parser.add_argument(
        "--precalculate-logprobs",
        choices=["on", "off"],
        default=None,
        help="art-ray's old logprobs from its trainer, not the engine (TRL always computes its own; "
        "default: the example's)",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="art-ray's gradient clip per optimizer step (default: the example's)",
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=None,
        help="art-ray's KL penalty against the base model (default: the example's)",
    )
    parser.add_argument(
        "--as-if-t1-beta",
        type=float,
        default=None,
        help="the as-if-temperature-1 arm's KL penalty (default: --beta's): the KL between policies "
        "tempered at T grows as 1/T^2 for a given change of logits and the policy-gradient term as 1/T, "
        "so a beta tuned on the old arm weighs 1/T times as much in the fixed one",
    )
    parser.add_argument(
        "--trained-at",
        choices=["recipe", "tempered", "one", "both"],
        default="recipe",
        help="art-ray's choices train by the example's own recipe (its TrainConfig.train_temperature), at "
        "the temperature they were sampled at (headline keys <task>_tempered_*), as if at 1 (how versions "
        "before issue 46 trained; old logprobs precalculated; <task>_as_if_t1_*), or both of those per seed",
    )
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="the PNG (default docs/learning_curves.png)")
    parser.add_argument(
        "--short",
        action="store_true",
        help="does it run: one seed, 2 minutes, the tiny model, code_math, 16 items (flags still apply)",
    )
    args = parser.parse_args(argv)
    short = args.short
    args.minutes = args.minutes if args.minutes is not None else 2.0 if short else 15.0
    args.seeds = args.seeds or ([0] if short else [0, 1, 2])
    args.tasks = args.tasks or (["code_math"] if short else ["code_math", "email_agent"])
    args.model = args.model or ("tiny" if short else "smollm2-135m")
    args.held_out = args.held_out or (16 if short else None)
    args.eval_every = args.eval_every or (1.0 if short else None)
    short_plot = Path(tempfile.gettempdir()) / "learning_curves_short.png"
    args.plot = args.plot or (short_plot if short else ROOT / "docs" / "learning_curves.png")
    args.box_gflops = []  # common.box_gflops() before and after the runs, where `run` makes them
    return args


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    result: dict = {"bench": "learning", "minutes": args.minutes, "seeds": args.seeds, "model": args.model}
    rows = []
    for run in runs:
        first, last = run["points"][0], run["points"][-1]
        low, high = wilson(last["correct"] * last["n"], last["n"])
        rows.append(
            [
                run["system"],
                run["task"],
                run["seed"],
                run["steps"],
                first["correct"],
                last["correct"],
                f"[{low:.2f}, {high:.2f}]",
                last["n"],
                run["eval_s"],
            ]
        )
    print_table(
        f"held-out correctness (greedy) before and after {args.minutes:g} training minutes",
        ["system", "task", "seed", "steps", "before", "after", "after 95% CI", "items", "eval s"],
        rows,
    )
    suffixes = {"art-ray": "", **dict(ARMS.values())}
    for system, task in sorted({(r["system"], r["task"]) for r in runs}):
        group = [r for r in runs if (r["system"], r["task"]) == (system, task)]
        prefix = task + suffixes[system] if system in suffixes else system
        base = statistics.median(r["points"][0]["correct"] for r in group)
        final = statistics.median(r["points"][-1]["correct"] for r in group)
        n = group[0]["points"][-1]["n"]
        result[f"{prefix}_base"] = round(base, 4)
        result[f"{prefix}_final"] = round(final, 4)
        # the difference of the figures as reported, so the line's numbers add up (6 items: thirds)
        result[f"{prefix}_lift"] = round(result[f"{prefix}_final"] - result[f"{prefix}_base"], 4)
        result[f"{prefix}_final_ci"] = [round(x, 4) for x in wilson(final * n, n)]
        result[f"{prefix}_steps"] = statistics.median(r["steps"] for r in group)
    trl = [r for r in runs if r["system"] == "trl"]
    ours = {r["seed"]: r for r in runs if r["system"] == "art-ray" and r["task"] == "code_math"}
    if trl and ours:
        # per seed, against TRL's run of that seed: the training minutes art-ray's run takes to reach the
        # TRL run's final (and best) held-out correctness, and the minutes TRL took to first reach it
        for target_name, pick in (("final", lambda points: points[-1]["correct"]), ("best", _best)):
            rows, mine, ratios = [], [], []
            for theirs in trl:
                target = pick(theirs["points"])
                trl_minutes = first_minutes_at(theirs["points"], target)
                ours_run = ours.get(theirs["seed"])
                minutes = first_minutes_at(ours_run["points"], target) if ours_run else None
                reached = minutes if minutes is not None else "not reached"
                rows.append([theirs["seed"], target, reached, trl_minutes])
                if minutes is not None:
                    mine.append(minutes)
                    if trl_minutes:
                        ratios.append(minutes / trl_minutes)
            print_table(
                f"training minutes to the {target_name} held-out correctness of TRL's run (per seed)",
                ["seed", f"TRL {target_name}", "art-ray minutes", "TRL minutes (its first evaluation there)"],
                rows,
            )
            complete = len(mine) == len(trl)
            result[f"trl_{target_name}"] = round(statistics.median(pick(r["points"]) for r in trl), 4)
            result[f"minutes_to_trl_{target_name}"] = round(statistics.median(mine), 3) if complete else None
            # TRL at (or below) its start: art-ray is there at minute 0, and the ratio says nothing
            ratio = round(statistics.median(ratios), 3) if len(ratios) == len(trl) else None
            result["ratio_to_trl" if target_name == "final" else "ratio_to_trl_best"] = ratio
    return result


async def run(
    args: argparse.Namespace,
    backend=None,
    free_trainer: Callable[[str], None] | None = None,  # noqa: ANN001
) -> dict:
    """The bench on `backend` (default: a RayBackend of its own, shut down after); prints and returns the
    headline figures. `free_trainer(name)` frees a finished run's trainer (default: stop them all)."""
    from art_ray import RayBackend

    tasks = bench_tasks(args)  # before the backend: its workers get the examples' folders on their path
    args.box_gflops.append(box_gflops())
    with tempfile.TemporaryDirectory() as workdir:
        own = backend is None
        if backend is None:
            backend = RayBackend(storage=f"{workdir}/art_ray", port=free_port())
        free = free_trainer or (lambda _name: backend.stop_trainers())
        try:
            runs = await art_ray_runs(args, tasks, backend, free)
        finally:
            if own:
                backend.shutdown()
        args.box_gflops.append(box_gflops())
        code_math = [task for task in tasks if task.name == "code_math"]
        if not args.skip_trl and code_math:
            for seed in args.seeds:
                runs.append(await asyncio.to_thread(trl_curve, args, seed, workdir, code_math[0]))
    return report(runs, args)


def report(runs: list[dict], args: argparse.Namespace) -> dict:
    """The plot, every run's curve beside it (to re-plot or compare later runs with), the tables and the
    last JSON line; returns the headline figures."""
    title = f"{args.model}, {len(args.seeds)} seed(s), {args.minutes:g} training minutes per run"
    plot(runs, args.plot, title)
    args.plot.with_suffix(".json").write_text(json.dumps({"title": title, "runs": runs}, indent=1))
    result = summarize(runs, args)
    result["plot"] = str(args.plot)
    if args.box_gflops:  # before and after art-ray's runs
        result["box_gflops"] = args.box_gflops
    print_result(result)
    return result


if __name__ == "__main__":
    asyncio.run(run(parse_args()))
