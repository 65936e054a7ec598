"""A deployed agent that learns from its own users: served, scored late, trained and released continuously.

    python examples/online/serve_and_learn.py --minutes 10
    python examples/online/serve_and_learn.py --minutes 10 --no-gates   # every trained step to everyone

SmolLM2-135M-Instruct is served under the run `online` with its traffic stored (ModelConfig.traffic). A
simulated population (examples/online/users.py) sends questions (each with its `user` and
`metadata["task"]`), likes one-word answers without saying so, and now and then sends a thumb late with
the response's feedback token. OnlineTrainer trains on the turns that feedback labeled, step after step;
with release gates (ModelConfig.release), each trained step first serves a share of the users and is
promoted or rolled back on what its turns show. Prints a row a minute: requests, the served replies' true
utility, the thumbs-up rate, the trained step and the release; as its last line one JSON object
{"example": "online", "first_utility", "last_utility", "steps", "rollbacks", "promotions", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from users import Population, Traffic, serve_population  # noqa: E402

from art_ray import (  # noqa: E402
    LoRASpec,
    ModelConfig,
    OnlineTrainConfig,
    OnlineTrainer,
    RayBackend,
    ReleasePolicy,
    TrafficConfig,
    TrainableModel,
    TrainConfig,
)
from art_ray.releases import describe  # noqa: E402


def online_model(args: argparse.Namespace) -> TrainableModel:
    release = None if args.no_gates else ReleasePolicy(stages=[0.25, 1.0], holdout=0.0, min_feedback=12)
    return TrainableModel(
        name=args.name,
        project="online",
        base_model=args.model,
        config=ModelConfig(
            lora=LoRASpec(r=16, alpha=32),
            sequence_length=512,
            max_model_len=512,
            max_num_seqs=32,
            traffic=TrafficConfig(mature_after_s=120, flush_s=10),
            release=release,
        ),
    )


def online_trainer(model: TrainableModel, args: argparse.Namespace) -> OnlineTrainer:
    train = TrainConfig(
        learning_rate=args.learning_rate, scale_rewards=False, truncated_importance_sampling=2.0
    )
    return OnlineTrainer(model, OnlineTrainConfig(min_turns=args.min_turns, poll_s=2.0, train=train))


async def report(model: TrainableModel, traffic: Traffic, minutes: int, done: asyncio.Event) -> None:
    """A row a minute: what the users saw in it, the trained step, the release."""
    header = f"{'minute':>6}  {'requests':>8}  {'utility':>7}  {'thumbs up':>9}  {'step':>4}  release"
    print(header, flush=True)
    for minute in range(minutes):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=60)
        start, end = minute * 60, (minute + 1) * 60
        state = (await model.release()).release if model.config.release else None
        utility, thumbs = traffic.mean("utility", start, end), traffic.mean("thumb", start, end)
        print(
            f"{minute + 1:>6}  {len(traffic.window(start, end)):>8}  {utility:>7.3f}  {thumbs:>9.3f}  "
            f"{await model.get_step():>4}  {describe(state) if state else 'no gates'}",
            flush=True,
        )
        if done.is_set():
            return


async def main(args: argparse.Namespace) -> dict:
    backend = RayBackend(storage=args.storage, port=args.port)
    model = online_model(args)
    await model.register(backend)
    trainer = online_trainer(model, args)
    training = asyncio.create_task(trainer.run())
    rng = random.Random(args.seed)
    population = Population.draw(
        rng, size=args.users, feedback_rate=args.feedback_rate, feedback_delay_s=args.feedback_delay_s
    )
    traffic, done = Traffic(), asyncio.Event()
    printing = asyncio.create_task(report(model, traffic, max(1, round(args.minutes)), done))
    try:
        await serve_population(
            model, population, rng, traffic, args.minutes * 60, args.rate, args.concurrency
        )
    finally:
        done.set()
        trainer.request_stop()
        await asyncio.gather(training, printing, return_exceptions=True)
    decisions = trainer.release_decisions
    last = max((reply.at_s for reply in traffic.served), default=0.0)
    result = {
        "example": "online",
        "gates": not args.no_gates,
        "first_utility": round(traffic.mean("utility", 0, 60), 3),
        "last_utility": round(traffic.mean("utility", last - 60, last + 1), 3),
        "requests": len(traffic.served),
        "steps": await model.get_step(),
        "turns_trained": sum(r.grouping.trajectories for r in trainer.reports),
        "rollbacks": sum(d.action == "rollback" for d in decisions),
        "promotions": sum(d.action == "promote" for d in decisions),
    }
    backend.shutdown()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the users send requests")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--feedback-rate", type=float, default=0.5, help="the share of replies a user scores")
    parser.add_argument("--feedback-delay-s", type=float, default=10.0, help="mean delay of a score")
    parser.add_argument("--min-turns", type=int, default=16, help="labeled turns per training step")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--no-gates", action="store_true", help="no release gates: each step to everyone")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="online")
    parser.add_argument("--storage", default="./art_ray_runs")
    parser.add_argument("--port", type=int, default=None, help="Serve's port (default: 8000 if free)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))), flush=True)
