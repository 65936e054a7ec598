"""art-ray's own rollout orchestration at 1,000 concurrent rollouts, against a stand-in server.

The stand-in answers every chat completion after a fixed 200 ms (a response shaped like art-ray's
endpoint: token ids and logprobs), on loopback, in its own process. Three ways to run the same 1,000
rollouts (100 groups x 10):

- bare: `asyncio.gather` of the OpenAI calls alone (no Trajectory, no art-ray) — the floor;
- driver: `gather_trajectory_groups` of rollout coroutines on the driver's event loop (ART's form);
- ray: the same rollout under `@art_ray.remote_rollout`, run by async Ray actors (warm pool).

At this scale the driver is CPU-bound (the OpenAI client's own work per call, ~4 ms here, dwarfs the
200 ms wait), so what art-ray adds shows up as wall time: overhead per rollout = (median wall of a form
- median wall of bare) / rollouts, over alternating rounds after a warm-up round of each. A rollout's
latency (table) is from the start of the gather to the moment the driver holds its result.
Last line: {"bench": "rollout_scale", "overhead_ms": ..., "overhead_ms_ray": ..., "failures": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table, start_local_ray  # noqa: E402

import art_ray  # noqa: E402
from art_ray import Model, Trajectory, TrajectoryGroup  # noqa: E402

RESPONSE = {
    "id": "chatcmpl-standin",
    "object": "chat.completion",
    "created": 0,
    "model": "standin",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Paris"},
            "logprobs": {
                "content": [{"token": "token_id:42", "logprob": -0.1, "bytes": None, "top_logprobs": []}]
            },
            "token_ids": [42],
            "prompt_token_ids": [1, 2, 3],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def serve_standin(port: int, latency: float) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        await request.json()
        await asyncio.sleep(latency)
        return web.json_response(RESPONSE)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, backlog=4096)


async def rollout(model: Model, index: int) -> Trajectory:
    messages = [{"role": "user", "content": f"question {index}"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=1
    )
    return Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=1.0)


async def timed(awaitable, start: float, latencies: list[float]):  # type: ignore[no-untyped-def]
    result = await awaitable
    latencies.append(time.perf_counter() - start)
    return result


async def run_bare(model: Model, count: int) -> tuple[float, list[float], int]:
    client = model.openai_client()
    latencies: list[float] = []
    start = time.perf_counter()
    calls = [
        timed(
            client.chat.completions.create(
                model="standin", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=1
            ),
            start,
            latencies,
        )
        for i in range(count)
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    failures = sum(isinstance(r, BaseException) for r in results)
    return time.perf_counter() - start, latencies, failures


async def run_gather(rollout_fn, model: Model, groups: int, size: int) -> tuple[float, list[float], int]:  # type: ignore[no-untyped-def]
    latencies: list[float] = []
    start = time.perf_counter()
    gathered = await art_ray.gather_trajectory_groups(
        (
            TrajectoryGroup(timed(rollout_fn(model, g * size + i), start, latencies) for i in range(size))
            for g in range(groups)
        ),
        max_exceptions=groups * size,
        pbar_desc=None,
    )
    failures = sum(len(g.exceptions) for g in gathered)
    return time.perf_counter() - start, latencies, failures


def runner_rss_mb(pool) -> float:  # type: ignore[no-untyped-def]
    import psutil
    import ray

    pids = ray.get([runner.pid.remote() for runner in pool.runners])
    return sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20


async def main(args: argparse.Namespace) -> dict:
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve_standin, args=(port, args.latency), daemon=True
    )
    server.start()
    model = Model(name="standin", project="bench", base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    for _ in range(100):  # wait for the stand-in to listen
        try:
            await run_bare(model, 1)
            break
        except Exception:
            await asyncio.sleep(0.1)
    count = args.groups * args.group_size
    rows, result = [], {"bench": "rollout_scale", "rollouts": count, "latency_ms": args.latency * 1000}

    start_local_ray(num_cpus=2)
    remote = art_ray.remote_rollout(rollout)
    runs = {
        "bare": lambda: run_bare(model, count),
        "driver": lambda: run_gather(rollout, model, args.groups, args.group_size),
        "ray": lambda: run_gather(remote, model, args.groups, args.group_size),
    }
    measured: dict[str, list[tuple[float, list[float], int]]] = {name: [] for name in runs}
    for round_index in range(args.rounds + 1):  # round 0 warms connections and the runner actors
        for name, run in runs.items():
            outcome = await run()
            if round_index:
                measured[name].append(outcome)
    driver_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ray_rss = runner_rss_mb(remote.pool)
    forms = []
    for name, outcomes in measured.items():
        wall = statistics.median(o[0] for o in outcomes)
        forms.append((name, wall, [x for o in outcomes for x in o[1]], sum(o[2] for o in outcomes)))
    bare_wall = forms[0][1]

    for name, wall, latencies, failures in forms:
        ordered = sorted(latencies)
        mean = statistics.fmean(latencies) if latencies else float("nan")
        overhead = (wall - bare_wall) * 1000 / count
        rows.append(
            [
                name,
                count,
                wall,
                mean * 1000,
                ordered[len(ordered) // 2] * 1000 if ordered else float("nan"),
                ordered[int(len(ordered) * 0.99) - 1] * 1000 if ordered else float("nan"),
                overhead if name != "bare" else 0.0,
                failures,
            ]
        )
        result[f"wall_s_{name}"] = round(wall, 3)
        if name != "bare":
            result["overhead_ms" if name == "driver" else "overhead_ms_ray"] = round(overhead, 2)
    print_table(
        f"{count} concurrent rollouts, stand-in server with {args.latency * 1000:.0f} ms latency (loopback), "
        f"median wall of {args.rounds} rounds",
        ["form", "rollouts", "wall s", "mean ms", "p50 ms", "p99 ms", "overhead ms", "failures"],
        rows,
    )
    print(f"\npeak driver RSS {driver_rss:.0f} MB; Ray runner actors RSS {ray_rss:.0f} MB total")
    result["failures"] = sum(form[3] for form in forms)  # over all measured rounds
    result["peak_driver_rss_mb"] = round(driver_rss, 1)
    result["ray_runners_rss_mb"] = round(ray_rss, 1)
    server.terminate()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=10)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=3)
    outcome = asyncio.run(main(parser.parse_args()))
    import ray

    ray.shutdown()
    print_result(outcome)
