"""Learning from served traffic (issue 47): one deployment, three runs of SmolLM2-135M serving the same
simulated population side by side (examples/online/users.py: users who like one-word answers without saying
so, and thumb a share of replies late, 10% flipped, 5% of them sycophants):

- frozen: the base model, never trained;
- gated: OnlineTrainer trains on its labeled turns, and each trained step goes out through a release
  (ModelConfig.release: a 5% canary first), promoted or rolled back by the release's sequential test;
- ungated: the same training, each trained step served to everyone at once.

In each learning arm, one bad version is published like any other at --bad-at-min: one step trained on the
arm's own kind of requests with the preference reversed (reward 1 - utility) at --bad-lr. Reported per
arm: served true utility per minute and its lift over the frozen arm, the thumbs-up rate beside it, the
bad version's exposure (seconds from its first request to its rollback or replacement, else to the
end of traffic, and the share of requests in that time that saw it) and the rollbacks of other
versions. The arms run in the same invocation, so they share the box's load. Last line: {"bench":
"online", "lift": {arm: ...}, ...}, medians over --seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples" / "online"))

from common import free_port, median, print_result, print_table, start_local_ray  # noqa: E402
from serve_and_learn import online_trainer  # noqa: E402
from users import MAX_TOKENS, Population, Traffic, serve_population, utility  # noqa: E402

from art_ray import (  # noqa: E402
    LoRASpec,
    ModelConfig,
    OnlineTrainer,
    RayBackend,
    ReleasePolicy,
    TrafficConfig,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)

ARMS = ("frozen", "gated", "ungated")


@dataclass
class BadVersion:
    step: int | None = None
    published_s: float | None = None
    ended_s: float | None = None  # rolled back (gated) or replaced by a newer step (ungated)


@dataclass
class Arm:
    name: str
    model: TrainableModel
    traffic: Traffic = field(default_factory=Traffic)
    trainer: OnlineTrainer | None = None
    bad: BadVersion = field(default_factory=BadVersion)


def arm_model(arm: str, seed: int, args: argparse.Namespace) -> TrainableModel:
    stages = [float(share) for share in args.stages.split(",")]
    gates = ReleasePolicy(stages=stages, min_feedback=args.min_feedback) if arm == "gated" else None
    return TrainableModel(
        name=f"online-{arm}-{seed}",
        project="bench-online",
        base_model=args.model,
        config=ModelConfig(
            lora=LoRASpec(r=16, alpha=32),
            sequence_length=512,
            max_model_len=512,
            max_num_seqs=32,
            replica_cpus=0,
            trainer_cpus_per_rank=0,
            share_trainer=True,  # the arms take turns on one trainer, as tenants of a deployment do
            traffic=TrafficConfig(mature_after_s=120, flush_s=10),  # the frozen arm's too: its users score it
            release=gates,
        ),
    )


async def bad_groups(
    model: TrainableModel, population: Population, rng: random.Random
) -> list[TrajectoryGroup]:
    """Groups sampled off the users' path (`store: false`), scored with the preference reversed."""

    async def sample(messages: list[dict]) -> Trajectory:
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, store=False
        )
        choice = completion.choices[0]
        return Trajectory(
            messages_and_choices=[*messages, choice],
            reward=1.0 - utility(choice.message.content or "", choice.finish_reason),
        )

    prompts = [population.request(rng)[2] for _ in range(4)]
    return [TrajectoryGroup(await asyncio.gather(*(sample(p) for p in prompts for _ in range(8))))]


async def learn(
    arm: Arm, population: Population, args: argparse.Namespace, clock, stop: asyncio.Event
) -> None:  # noqa: ANN001
    """OnlineTrainer's loop, with the bad version published once when its time comes (while no canary
    runs: it is released as any trained step is)."""
    trainer, model = arm.trainer, arm.model
    assert trainer is not None
    rng = random.Random(args.seed_base)
    while not stop.is_set():
        release = (await model.release()).release if model.config.release is not None else None
        if release is not None:
            await trainer.check_release()
        idle = release is None or release.status == "stable"
        if arm.bad.step is None and clock() >= args.bad_at_min * 60 and idle:
            groups = await bad_groups(model, population, rng)
            step = await model.train(groups, TrainConfig(learning_rate=args.bad_lr), verbose=False)
            if release is not None:
                await model.release("start", step)
            arm.bad = BadVersion(step=step, published_s=clock())
            continue
        if await trainer.step() is None:
            await asyncio.sleep(2.0)


async def watch_bad_version(arm: Arm, clock, stop: asyncio.Event) -> None:  # noqa: ANN001
    """When the bad version stops being served: rolled back, or a newer step serves everyone."""
    while not stop.is_set() and arm.bad.ended_s is None:
        await asyncio.sleep(1.0)
        if arm.bad.step is None:
            continue
        if arm.model.config.release is not None:
            release = (await arm.model.release()).release
            if release is not None and arm.bad.step in release.rejected:
                arm.bad.ended_s = clock()
        elif await arm.model.get_step() > arm.bad.step:
            arm.bad.ended_s = clock()


def exposure(arm: Arm) -> dict:
    """The bad version's first request to its end, and the share of requests in that time that it served."""
    bad = arm.bad
    seen = [reply.at_s for reply in arm.traffic.served if reply.version == bad.step]
    if bad.step is None or not seen:
        return {"bad_step": bad.step, "bad_seconds": None, "bad_share": None, "bad_requests": 0}
    end = bad.ended_s if bad.ended_s is not None else max(reply.at_s for reply in arm.traffic.served)
    window = arm.traffic.window(min(seen), end)
    share = sum(reply.version == bad.step for reply in window) / max(1, len(window))
    return {
        "bad_step": bad.step,
        "bad_seconds": round(end - min(seen), 1),
        "bad_share": round(share, 3),
        "bad_requests": len(seen),
        "bad_ended": bad.ended_s is not None,
    }


def minute_means(traffic: Traffic, minutes: int, attribute: str) -> list[float]:
    return [traffic.mean(attribute, minute * 60, (minute + 1) * 60) for minute in range(minutes)]


async def one_seed(backend: RayBackend, seed: int, args: argparse.Namespace) -> dict:
    arms = [Arm(name, arm_model(name, seed, args)) for name in ARMS]
    for arm in arms:
        await arm.model.register(backend)
        if arm.name != "frozen":
            arm.trainer = online_trainer(arm.model, args)  # the example's
    started = time.monotonic()

    def clock() -> float:
        return time.monotonic() - started

    stop = asyncio.Event()
    populations = {
        arm.name: Population.draw(
            random.Random(seed),
            size=args.users,
            feedback_rate=args.feedback_rate,
            feedback_delay_s=args.feedback_delay_s,
        )
        for arm in arms
    }
    background = [
        asyncio.create_task(task)
        for arm in arms
        if arm.trainer is not None
        for task in (
            learn(arm, populations[arm.name], args, clock, stop),
            watch_bad_version(arm, clock, stop),
        )
    ]
    await asyncio.gather(
        *(
            serve_population(
                arm.model,
                populations[arm.name],
                random.Random(seed),
                arm.traffic,
                args.minutes * 60,
                args.rate,
                args.concurrency,
            )
            for arm in arms
        )
    )
    stop.set()
    await asyncio.gather(*background)
    minutes = round(args.minutes)
    result = {"seed": seed}
    frozen = statistics.fmean(r.utility for r in arms[0].traffic.served)
    for arm in arms:
        curve = minute_means(arm.traffic, minutes, "utility")
        last = arm.traffic.mean("utility", (minutes - args.last_min) * 60, minutes * 60)
        thumbs = [r.thumb for r in arm.traffic.served if r.thumb is not None]
        release = (await arm.model.release()).release if arm.model.config.release is not None else None
        rejected = release.rejected if release is not None else ()
        result[arm.name] = {
            "curve": [round(value, 3) for value in curve],
            "last": round(last, 3),
            "lift": round(last - frozen, 3),
            "thumbs_up": round(statistics.fmean(thumbs), 3) if thumbs else None,
            "utility": round(statistics.fmean(r.utility for r in arm.traffic.served), 3),
            "requests": len(arm.traffic.served),
            "steps": await arm.model.get_step(),
            "rollbacks_of_others": len(set(rejected) - {arm.bad.step}),
            **(exposure(arm) if arm.trainer is not None else {}),
        }
        await backend.delete_run(arm.model)
    return result


async def run(args: argparse.Namespace) -> list[dict]:
    backend = RayBackend(storage=args.storage or tempfile.mkdtemp(prefix="art-ray-online-"), port=free_port())
    try:
        return [
            await one_seed(backend, seed, args) for seed in range(args.seed_base, args.seed_base + args.seeds)
        ]
    finally:
        backend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic per seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-base", type=int, default=0)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second per arm (Poisson)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight per arm at most")
    parser.add_argument("--feedback-rate", type=float, default=0.3)
    parser.add_argument("--feedback-delay-s", type=float, default=20.0)
    parser.add_argument("--min-turns", type=int, default=16)
    parser.add_argument("--min-feedback", type=int, default=10, help="ReleasePolicy.min_feedback")
    parser.add_argument("--stages", default="0.05,0.5,1.0", help="ReleasePolicy.stages, comma-separated")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--bad-at-min", type=float, default=None, help="default: a third of --minutes")
    parser.add_argument("--bad-lr", type=float, default=1e-2)
    parser.add_argument("--last-min", type=int, default=3, help="the minutes whose utility is the result")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--storage", default=None)
    args = parser.parse_args()
    if args.bad_at_min is None:
        args.bad_at_min = args.minutes / 3
    start_local_ray()
    results = asyncio.run(run(args))
    print_table(
        f"served true utility per minute (seed {args.seed_base})",
        ["minute", *ARMS],
        [[m + 1, *(results[0][arm]["curve"][m] for arm in ARMS)] for m in range(round(args.minutes))],
    )
    rows = []
    for arm in ARMS:
        per_seed = [result[arm] for result in results]
        rows.append(
            [
                arm,
                median([r["last"] for r in per_seed]),
                median([r["lift"] for r in per_seed]),
                median([r["thumbs_up"] for r in per_seed if r["thumbs_up"] is not None] or [float("nan")]),
                median([r["utility"] for r in per_seed]),
                median([r["steps"] for r in per_seed]),
                *(
                    [
                        median(
                            [r["bad_seconds"] for r in per_seed if r["bad_seconds"] is not None]
                            or [float("nan")]
                        ),
                        median(
                            [r["bad_share"] for r in per_seed if r["bad_share"] is not None] or [float("nan")]
                        ),
                        sum(r["rollbacks_of_others"] for r in per_seed),
                        f"{sum(bool(r.get('bad_ended')) for r in per_seed)}/{len(per_seed)}",
                    ]
                    if arm != "frozen"
                    else ["", "", "", ""]
                ),
            ]
        )
    print_table(
        f"{args.seeds} seeds x {args.minutes:g} min, {args.rate:g} req/s per arm (medians over seeds)",
        [
            "arm",
            f"utility, last {args.last_min} min",
            "lift over frozen",
            "thumbs up",
            "utility, all",
            "steps",
            "bad version served (s)",
            "bad share",
            "other rollbacks",
            "bad ended (seeds)",  # rolled back (gated) or replaced (ungated) before traffic ended
        ],
        rows,
    )
    print_result(
        {
            "bench": "online",
            "minutes": args.minutes,
            "seeds": args.seeds,
            "lift": {row[0]: row[2] for row in rows},
            "last_utility": {row[0]: row[1] for row in rows},
            "bad_seconds": {row[0]: row[6] for row in rows if row[0] != "frozen"},
            "bad_share": {row[0]: row[7] for row in rows if row[0] != "frozen"},
            "other_rollbacks": {row[0]: row[8] for row in rows if row[0] != "frozen"},
            "bad_ended": {row[0]: row[9] for row in rows if row[0] != "frozen"},
            "per_seed": results,
        }
    )


if __name__ == "__main__":
    main()
