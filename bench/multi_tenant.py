"""Many runs, one deployment (issue 27): --runs one-word demo runs (examples/one_word/train.py), each with
its own seed, trained three ways, each way in a fresh process tree whose memory is sampled:

- concurrent: one RayBackend; the runs registered on it (the first starts the engine and the trainer, the
  others join that trainer: `share_trainer`) and their training loops run at once;
- in_turn: the same deployment, the same registrations, the loops one after another;
- scripts: today's way: the demo script once per run, one after another, each with its own backend.

Every run makes the demo's --steps (8), as `make demo` does, so the ways' wall times compare the system
and not how many steps each seed happened to need; a run has reached the demo's threshold when one of its
held-out evaluations scored held-out exact >= --threshold. With --stop-at-threshold a run stops there
instead (at most --steps). The shared ways size the engine for all runs' samples at once (`max_num_seqs`
= runs x a step's samples).

Reported per way: wall time (the way's process from its start to its exit: every start and stop included),
each run's steps and final held-out exact, the engine's and the trainer's busy fractions (the share of the
loops' wall time in which some run was sampling or evaluating / some train call was in flight: the
in-process ways only) and the peak PSS of the way's whole process tree (bench/memory.py's sampling).
Ratios: concurrent / scripts and concurrent / in_turn wall time, concurrent peak / one run's peak (the
scripts way runs one at a time: its peak is one run's).

    python bench/multi_tenant.py                  # 4 runs, the three ways (~12 minutes here)
    python bench/multi_tenant.py --ways concurrent --runs 2

Last line: {"bench": "multi_tenant", "runs", "wall_s": {way: s}, "ratio_concurrent_to_scripts",
"ratio_concurrent_to_in_turn", "peak_gib": {way: GiB}, "memory_ratio", "all_reached_threshold", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "one_word"))

from common import free_port, print_result, print_table  # noqa: E402
from memory import GIB, sample  # noqa: E402

ROOT = Path(__file__).parents[1]
DEMO = ROOT / "examples" / "one_word" / "train.py"
WAYS = ("concurrent", "in_turn", "scripts")


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def steps_args(args: argparse.Namespace) -> list[str]:
    """Every run makes --steps steps, or with --stop-at-threshold stops at --threshold."""
    stop = ["--stop-at-exact", str(args.threshold)] if args.stop_at_threshold else []
    return ["--steps", str(args.steps), *stop]


def demo_args(args: argparse.Namespace, seed: int, extra: list[str] | None = None):  # noqa: ANN201
    import train  # examples/one_word/train.py

    return train.parse_args(["--model", args.model, "--seed", str(seed), *steps_args(args), *(extra or [])])


async def shared_deployment(args: argparse.Namespace, concurrent: bool, storage: str) -> dict:
    """The runs on one RayBackend: registered one after another, trained at once or in turn."""
    import train  # examples/one_word/train.py

    from art_ray import RayBackend

    started = time.time()
    backend = RayBackend(storage=storage, port=free_port())
    seeds = list(range(args.runs))
    step_samples = 4 * 8  # the demo's groups per step x group size
    config = json.dumps(
        {"share_trainer": True, "max_num_seqs": step_samples * args.runs, "layout": args.layout}
    )
    runs = {seed: demo_args(args, seed, ["--model-config", config]) for seed in seeds}
    models = {seed: train.demo_model(runs[seed], name=f"tenant-{seed}") for seed in seeds}
    phases: train.Phases = []
    try:
        for seed in seeds:
            await models[seed].register(backend)
        registered = time.time()

        async def one(seed: int) -> dict:
            def say(line: str) -> None:
                print(f"[tenant-{seed}] {line.strip()}", flush=True)

            return await train.train_loop(models[seed], runs[seed], seed=seed, say=say, phases=phases)

        if concurrent:
            results = await asyncio.gather(*(one(seed) for seed in seeds))
        else:
            results = [await one(seed) for seed in seeds]
        finished = time.time()
    finally:
        backend.shutdown()
    loops_s = finished - registered
    return {
        "wall_s": finished - started,
        "register_s": registered - started,
        "runs": [{"seed": seed, **result} for seed, result in zip(seeds, results, strict=True)],
        "engine_busy": covered([(a, b) for kind, a, b in phases if kind == "sample"]) / loops_s,
        "trainer_busy": covered([(a, b) for kind, a, b in phases if kind == "train"]) / loops_s,
    }


def scripts(args: argparse.Namespace, storage: str) -> dict:
    """The demo script once per run, one after another, each with its own backend (and Ray)."""
    started = time.time()
    runs = []
    for seed in range(args.runs):
        command = [
            sys.executable, str(DEMO), "--model", args.model, "--seed", str(seed), "--name", f"script-{seed}",
            *steps_args(args), "--storage", f"{storage}/{seed}", "--port", str(free_port()),
        ]  # fmt: skip
        completed = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if completed.returncode != 0:
            raise RuntimeError(f"the demo script (seed {seed}) failed:\n{completed.stderr[-3000:]}")
        result = json.loads(completed.stdout.strip().splitlines()[-1])
        print(f"[script-{seed}] {result}", flush=True)
        runs.append({"seed": seed, **result})
    return {"wall_s": time.time() - started, "runs": runs, "engine_busy": None, "trainer_busy": None}


def child(args: argparse.Namespace) -> None:
    """One way, in this process (the parent samples its process tree)."""
    with tempfile.TemporaryDirectory() as storage:
        if args.child == "scripts":
            result = scripts(args, storage)
        else:
            result = asyncio.run(shared_deployment(args, args.child == "concurrent", storage))
    print_result({"way": args.child, **result})


def run_way(way: str, args: argparse.Namespace) -> dict:
    """The way in a child process, its tree's summed PSS sampled every --interval seconds."""
    command = [sys.executable, __file__, "--child", way, *forwarded(args)]
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak, peak_roles = 0, {}
    done = threading.Event()

    def watch() -> None:
        nonlocal peak, peak_roles
        while not done.is_set():
            roles = sample(process.pid, {})
            if sum(roles.values()) > peak:
                peak, peak_roles = sum(roles.values()), roles
            done.wait(args.interval)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        if line.startswith(("[", "art-ray: tenant-0:")):
            print(f"{way}: {line}", end="", flush=True)
        last = line
    done.set()
    watcher.join()
    if process.wait() != 0:
        raise RuntimeError(f"the {way} way failed (exit {process.returncode}); its stderr is above")
    # the wall time a user waits: the way's process from its start to its exit, Ray's starts and stops in
    roles = {role: round(pss / GIB, 2) for role, pss in sorted(peak_roles.items(), key=lambda item: -item[1])}
    return {**json.loads(last), "wall_s": time.time() - started, "peak_gib": peak / GIB, "peak_roles": roles}


def forwarded(args: argparse.Namespace) -> list[str]:
    stop = ["--stop-at-threshold"] if args.stop_at_threshold else []
    return [
        "--runs", str(args.runs), "--model", args.model, "--threshold", str(args.threshold),
        "--steps", str(args.steps), "--layout", args.layout, *stop,
    ]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--ways", type=lambda text: text.split(","), default=list(WAYS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threshold", type=float, default=0.8, help="held-out exact a run must reach")
    parser.add_argument("--steps", type=int, default=8, help="steps each run makes (the demo's 8)")
    parser.add_argument(
        "--stop-at-threshold",
        action="store_true",
        help="each run stops once it reaches --threshold (at most --steps): wall times then also depend on "
        "how many steps each seed happened to need",
    )
    parser.add_argument(
        "--layout",
        choices=["auto", "colocated", "split"],
        default="split",
        help="the shared deployment's layout (split: the engine samples one run while another trains, one "
        "core each; on this 2-core box it is the faster of the two for both shared ways); the scripts way "
        "runs the demo as users do (its default layout, colocated here)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("--child", choices=WAYS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}: choose from {', '.join(WAYS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    results = {way: run_way(way, args) for way in args.ways}
    rows = []
    for way, result in results.items():
        for run in result["runs"]:
            rows.append(
                [way, run["seed"], run["steps"], run["baseline_exact"], run["best_exact"], run["final_exact"]]
            )
    goal = (
        f"each to held-out exact >= {args.threshold} (at most {args.steps} steps)"
        if args.stop_at_threshold
        else f"{args.steps} steps each"
    )
    print_table(
        f"{args.runs} one-word runs, {goal}, shared deployment layout {args.layout}",
        ["way", "seed", "steps", "held-out exact before", "best", "after"],
        rows,
    )
    print_table(
        "per way",
        ["way", "wall s", "engine busy", "trainer busy", "peak GiB (PSS, all processes)"],
        [
            [way, r["wall_s"], r["engine_busy"] or "-", r["trainer_busy"] or "-", r["peak_gib"]]
            for way, r in results.items()
        ],
    )
    roles = sorted({role for r in results.values() for role in r["peak_roles"]})
    print_table(
        "PSS by process role at each way's peak (GiB)",
        ["role", *results],
        [[role, *(r["peak_roles"].get(role, 0.0) for r in results.values())] for role in roles],
    )
    wall = {way: round(r["wall_s"], 1) for way, r in results.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(wall[a] / wall[b], 3) if a in wall and b in wall else None

    peak = {way: round(r["peak_gib"], 2) for way, r in results.items()}
    summary = {
        "bench": "multi_tenant",
        "runs": args.runs,
        "wall_s": wall,
        "ratio_concurrent_to_scripts": ratio("concurrent", "scripts"),
        "ratio_concurrent_to_in_turn": ratio("concurrent", "in_turn"),
        "peak_gib": peak,
        "memory_ratio": round(peak["concurrent"] / peak["scripts"], 3)
        if {"concurrent", "scripts"} <= peak.keys()
        else None,
        "steps": {way: [run["steps"] for run in r["runs"]] for way, r in results.items()},
        "final_exact": {way: [run["final_exact"] for run in r["runs"]] for way, r in results.items()},
        "best_exact": {way: [run["best_exact"] for run in r["runs"]] for way, r in results.items()},
        "all_reached_threshold": all(
            run["best_exact"] >= args.threshold for r in results.values() for run in r["runs"]
        ),
        **{
            phase: {way: r[phase] and round(r[phase], 3) for way, r in results.items()}
            for phase in ("engine_busy", "trainer_busy")
        },
    }
    print(
        "\nOn this 2-core box every phase is CPU-bound on the same two cores: runs at once gain by batching "
        "several runs' samples in one engine step and, in the split layout, by keeping the engine's core and "
        "the trainer's core busy with different runs; the shared start is paid once instead of once a run."
    )
    print_result(summary)


if __name__ == "__main__":
    main()
