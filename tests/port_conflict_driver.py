"""A driver with an embedded RayBackend of its own, for tests/test_port_conflicts.py (one Ray cluster per
process, so two deployments on one machine need two processes).

    serve: once Ray is up and the go file is there, start Serve and the inference app the way `register`
           does, with the backend's default port;
           once the peer is up too, ask the endpoint 50 times through the SDK's client and 50 times with no
           identity (a fresh connection each: the kernel spreads connections, not requests), and once
           for the peer's identity; write what answered, then wait for the release file.
    ask:   register a model on backends asking for the given ports explicitly; write what each raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

API_KEY = "k"


def wait_for(path: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.2)


def write_json(path: Path, payload: dict) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(payload))
    scratch.rename(path)  # whole or not at all: the other side polls for it


async def answers(base_url: str, deployment: str, peer: str) -> dict:
    from art_ray.deployment import DEPLOYMENT_HEADER
    from art_ray.model import shared_client

    client = shared_client(base_url, API_KEY, deployment)  # what model.openai_client() returns
    with_identity = []
    for _ in range(50):
        response = await client.models.with_raw_response.list()
        with_identity.append(response.headers.get(DEPLOYMENT_HEADER))
    without_identity = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for _ in range(50):
        async with httpx.AsyncClient() as fresh:  # a new connection each time
            response = await fresh.get(f"{base_url}/models", headers=headers)
        without_identity.append((response.status_code, response.headers.get(DEPLOYMENT_HEADER)))
    async with httpx.AsyncClient() as fresh:
        misdirected = await fresh.get(f"{base_url}/models", headers={**headers, DEPLOYMENT_HEADER: peer})
    return {
        "with_identity": with_identity,
        "without_identity": without_identity,
        "misdirected": [misdirected.status_code, misdirected.json()],
    }


def serve_mode(args: argparse.Namespace) -> None:
    from art_ray import RayBackend
    from art_ray.deployment import deployment_identity
    from art_ray.models import TINY, prepare
    from art_ray.serving.config import ServingConfig
    from art_ray.serving.engine_config import EngineConfig
    from art_ray.serving.launch import start_inference

    backend = RayBackend(storage=args.storage, api_key=API_KEY)  # the default port
    # Ray's own start first: two local clusters starting at the same moment on two cores time out in
    # Ray (its raylet registration); what is tested is the moment after, Serve's start, made at once
    backend._connect()
    Path(args.connected).touch()
    wait_for(Path(args.go))
    host, port = backend.start_serve()
    deployment = deployment_identity(backend.app_name)
    config = ServingConfig(
        engine=EngineConfig(model=str(prepare(TINY)), max_model_len=256, threads=1),
        num_replicas=1,
        replica_cpus=1,
        api_key=API_KEY,
    )
    base_url = start_inference(config, backend.host, backend.port, deployment=deployment)
    ready = Path(args.ready)
    write_json(ready, {"port": port, "base_url": base_url, "deployment": deployment})
    wait_for(Path(args.peer))
    peer = json.loads(Path(args.peer).read_text())["deployment"]
    write_json(
        Path(args.out),
        {"port": port, "deployment": deployment, **asyncio.run(answers(base_url, deployment, peer))},
    )
    wait_for(Path(args.release))
    backend.shutdown()


def ask_mode(args: argparse.Namespace) -> None:
    from art_ray import RayBackend, TrainableModel
    from art_ray.models import TINY

    outcomes = []
    backends = []
    for port in args.ports:
        backend = RayBackend(storage=args.storage, port=port)
        backends.append(backend)
        backend._connect()  # the embedded cluster's start is not what is timed
        model = TrainableModel(name="asks", project="tests", base_model=TINY)
        started = time.monotonic()
        try:
            asyncio.run(model.register(backend))
            outcome = {"raised": None}
        except Exception as error:  # noqa: BLE001 - the test judges what was raised
            outcome = {"raised": type(error).__name__, "message": str(error)}
        outcomes.append({"port": port, "seconds": time.monotonic() - started, **outcome})
    write_json(Path(args.out), {"outcomes": outcomes})
    backends[0].shutdown()  # the first started the embedded cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "ask"])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connected")
    parser.add_argument("--go")
    parser.add_argument("--ready")
    parser.add_argument("--peer")
    parser.add_argument("--release")
    parser.add_argument("--ports", type=int, nargs="*", default=[])
    args = parser.parse_args()
    serve_mode(args) if args.mode == "serve" else ask_mode(args)


if __name__ == "__main__":
    main()
