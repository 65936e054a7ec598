"""MkDocs hook: the site's pages that are made from other sources, so they cannot drift from them.

- `<!-- art-ray-cli -->` (docs/reference/cli.md) becomes the help of every `art-ray` command and
  subcommand, rendered from `art_ray.cli.build_parser()` at build time: a new subcommand or option is in
  the reference the next time the site builds.
- `<!-- include: examples/NAME/README.md -->` becomes that README (the example's one source of truth),
  its relative links rewritten for the page's place in the site: `../../docs/x` (a figure under docs/)
  to the file in the site, a link to a file of the example's folder to its place in the repository.

Plain functions, so tests/test_docs.py calls them without a build.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI_MARKER = "<!-- art-ray-cli -->"
INCLUDE = re.compile(r"<!-- include: (examples/[\w/]+\.md) -->")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.extend(action.choices.items())
    return found


def cli_commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command of `art-ray`, depth first: ("art-ray", parser), ("art-ray models", ...), ..."""
    from art_ray.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal's width: fix it for the page
    commands = []

    def walk(prog: str, parser: argparse.ArgumentParser) -> None:
        commands.append((prog, parser))
        for name, sub in _subcommands(parser):
            walk(f"{prog} {name}", sub)

    walk("art-ray", build_parser())
    return commands


def cli_reference() -> str:
    sections = []
    for prog, parser in cli_commands():
        parser.prog = prog
        level = "#" * min(2 + prog.count(" "), 4)
        sections.append(f"{level} `{prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def include_example(relative: str, page_src: str) -> str:
    """The README at `relative` (from the repository root) for the page at `page_src` (from docs/)."""
    source = ROOT / relative
    text = source.read_text()
    page_dir = (ROOT / "docs" / page_src).parent

    def rewrite(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"[a-z]+:|#|/", target):
            return match.group(0)
        resolved = (source.parent / target).resolve()
        if not resolved.is_relative_to(ROOT / "docs"):  # a file of the repository, not of the site
            return f"{text} (`{resolved.relative_to(ROOT)}`)"
        return f"{bang}[{text}]({os.path.relpath(resolved, page_dir)})"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", rewrite, text)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return INCLUDE.sub(lambda m: include_example(m.group(1), page.file.src_uri), markdown)
