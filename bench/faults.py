"""Fault injection: a short real run (the `tiny` model, 2 replicas, GRPO steps on the embedded local Ray)
in which art-ray loses, in turn, an inference replica, a trainer rank, the LoRA registry and the driver.

Each fault strikes before a step's rollouts: the replica and the trainer rank are killed as a lost node
kills them, the registry as a crash (Ray restarts it), and the driver process SIGKILLs itself while its
rollouts are in flight (its embedded Ray goes with it); a new driver on the same storage then resumes.
After every train call the driver asks the endpoint for `name`: a reply sampled by an older step than the
one train() returned is a silent stale step. Right after the replica dies, the endpoint is probed one request
at a time without client retries: with 2 replicas a lost one should fail no request.

Counted at the end, from storage and MLflow: steps lost (the run ends short of --steps), trajectories lost
(a trained step whose Parquet lacks rows; the rollouts a killed driver had in flight were never trained and
are not counted), metric rows logged twice for one step, and the run's status.
Last line: {"bench": "faults", "faults", "survived", "steps_lost", "trajectories_lost",
"silent_stale_steps", "duplicated_metric_rows", "run_status", "replica_kill_requests",
"replica_kill_failed_requests", "replica_kill_outage_s", "seconds"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table  # noqa: E402

# the fault that strikes before the rollouts of the step the model is at
FAULTS = {1: "replica", 2: "trainer_rank", 3: "registry", 4: "driver"}
MODEL, PROJECT = "faults", "bench"
# how long the endpoint is probed after the replica fault
PROBE_SECONDS = 10.0
PROMPTS = ["Name a color.", "Say a number.", "Pick an animal.", "Name a fruit."]


def config():  # noqa: ANN201
    from art_ray import LoRASpec, ModelConfig

    # nothing reserved: 2 replicas and the trainer fit on 2 cores, as in the tests
    return ModelConfig(
        lora=LoRASpec(r=8, alpha=16),
        sequence_length=256,
        max_model_len=512,
        num_replicas=2,
        replica_cpus=0,
        trainer_cpus_per_rank=0,
    )


def record(progress: Path, **line: object) -> None:
    with progress.open("a") as out:
        out.write(json.dumps(line) + "\n")
        out.flush()
        os.fsync(out.fileno())


def injected(progress: Path) -> set[str]:
    if not progress.exists():
        return set()
    return {line["fault"] for line in map(json.loads, progress.read_text().splitlines()) if "fault" in line}


async def strike(fault: str, backend, model, progress: Path) -> None:  # noqa: ANN001
    import ray

    from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry

    record(progress, fault=fault, step=await model.get_step())
    if fault == "replica":
        name = next(
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(f"SERVE_REPLICA::{backend.app_name}#{INFERENCE_DEPLOYMENT}")
        )
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)  # Serve starts another
    elif fault == "trainer_rank":
        ray.kill(backend._trainers[model.name].workers[0])
    elif fault == "registry":
        ray.kill(get_registry(), no_restart=False)


async def drive(args: argparse.Namespace) -> None:
    """One driver process: register (resuming), then steps until --steps, with the faults due."""
    import art_ray
    from art_ray import RayBackend, TrainableModel, Trajectory, TrajectoryGroup, sampled_tokens

    progress = Path(args.storage) / "progress.jsonl"
    backend = RayBackend(storage=args.storage, port=free_port(), app_name="faults", route_prefix="/faults")
    model = TrainableModel(name=MODEL, project=PROJECT, base_model="tiny", config=config())
    await model.register(backend)
    client = model.openai_client()

    async def rollout(prompt: str) -> Trajectory:
        messages = [{"role": "user", "content": prompt}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0
        )
        choice = completion.choices[0]
        reward = float(sampled_tokens(choice).token_ids[0] % 2)
        return Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    while (step := await model.get_step()) < args.steps:
        fault = FAULTS.get(step)
        due = fault is not None and fault not in injected(progress)
        if due:
            await strike(fault, backend, model, progress)
        groups = asyncio.ensure_future(
            art_ray.gather_trajectory_groups(
                (TrajectoryGroup(rollout(p) for _ in range(args.group_size)) for p in PROMPTS[: args.groups]),
                pbar_desc=None,
            )
        )
        if due and fault == "replica":  # with 2 replicas the endpoint should not go down: count failures
            await probe_endpoint(model, progress)
        if due and fault == "driver":
            await asyncio.sleep(0.3)  # rollouts in flight
            os.kill(os.getpid(), signal.SIGKILL)
        new_step = await model.train(await groups, verbose=False)
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        served = reply.choices[0].model_extra["policy_version"]
        record(progress, step=new_step, served=served)
    backend.shutdown()


async def probe_endpoint(model, progress: Path, seconds: float = PROBE_SECONDS) -> None:  # noqa: ANN001
    """Right after a replica died: one request at a time, no client retries, for `seconds`; records how
    many failed and the longest stretch between a failure and the next success."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=model.base_url, api_key=model.api_key or "none", max_retries=0, timeout=30
    )
    sent = failed = 0
    outage_started: float | None = None
    longest_outage = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent += 1
        try:
            await client.chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            if outage_started is not None:
                longest_outage = max(longest_outage, time.monotonic() - outage_started)
                outage_started = None
        except openai.OpenAIError:
            failed += 1
            outage_started = outage_started or time.monotonic()
    if outage_started is not None:
        longest_outage = max(longest_outage, time.monotonic() - outage_started)
    record(progress, probe="replica", sent=sent, failed=failed, longest_outage_s=round(longest_outage, 2))


def count_results(storage: Path, steps: int, expected_rows: int) -> dict:
    import mlflow
    import pyarrow.parquet as pq

    lines = [json.loads(line) for line in (storage / "progress.jsonl").read_text().splitlines()]
    trained = {line["step"]: line["served"] for line in lines if "served" in line}
    final = max(trained, default=0)
    folder = storage / PROJECT / "models" / MODEL / "trajectories" / "train"
    lost = 0
    for step in range(final):
        path = folder / f"{step:04d}.parquet"
        rows = pq.read_table(path).num_rows if path.exists() else 0
        lost += max(0, expected_rows - rows)
    client = mlflow.MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = client.get_experiment_by_name(PROJECT)
    run = client.search_runs([experiment.experiment_id])[0]
    duplicated = 0
    for metric in run.data.metrics:
        steps_logged = [row.step for row in client.get_metric_history(run.info.run_id, metric)]
        duplicated += len(steps_logged) - len(set(steps_logged))
    struck = [(line["fault"], line["step"]) for line in lines if "fault" in line]
    probe = next((line for line in lines if line.get("probe") == "replica"), {})
    return {
        "replica_kill_requests": probe.get("sent", 0),
        "replica_kill_failed_requests": probe.get("failed", 0),
        "replica_kill_outage_s": probe.get("longest_outage_s", 0.0),
        "final_step": final,
        "survived": [fault for fault, step in struck if trained.get(step + 1) == step + 1],
        "struck": struck,
        "steps_lost": steps - final,
        "trajectories_lost": lost,
        "silent_stale_steps": sum(served != step for step, served in trained.items()),
        "duplicated_metric_rows": duplicated,
        "run_status": run.info.status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--storage", default=None, help="a fresh folder (default: a temporary one)")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        asyncio.run(drive(args))
        return
    storage = Path(args.storage or tempfile.mkdtemp(prefix="art-ray-faults-"))
    command = [
        sys.executable,
        __file__,
        "--driver",
        f"--storage={storage}",
        f"--steps={args.steps}",
        f"--groups={args.groups}",
        f"--group-size={args.group_size}",
    ]
    start = time.monotonic()
    first = subprocess.run(command, timeout=900)
    if first.returncode == -signal.SIGKILL:  # the driver fault: a new driver on the same storage resumes
        subprocess.run(command, timeout=900, check=True)
    else:
        first.check_returncode()
    seconds = time.monotonic() - start
    counts = count_results(storage, args.steps, args.groups * args.group_size)
    struck, survived = counts.pop("struck"), counts.pop("survived")
    print_table(
        f"fault injection: tiny model, 2 replicas, {args.steps} steps of {args.groups} x {args.group_size}",
        ["fault", "before step", "next step trained and served"],
        [[fault, step, fault in survived] for fault, step in struck],
    )
    print_table("what the run kept", ["count", "value"], [[key, value] for key, value in counts.items()])
    print_result(
        {
            "bench": "faults",
            "faults": len(FAULTS),
            "survived": len(survived),
            **{key: value for key, value in counts.items() if key != "final_step"},
            "seconds": round(seconds, 1),
        }
    )


if __name__ == "__main__":
    main()
