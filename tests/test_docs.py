"""The documentation cannot rot silently: the site builds with `mkdocs build --strict` (a broken link, a
missing page, a snippet or a reference that does not resolve fails it), the API reference lists every name
of `art_ray.__all__` and the CLI reference every `art-ray` command, the troubleshooting page names every
error class, every command on a page is run by a test or marked as not run, and the README stays a
five-minute read whose example is the quickstart's tested code.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
COMMAND_LANGUAGES = {"python", "bash", "sh", "shell", "console", "pycon"}
RUN_MARKER = re.compile(r"<!-- run by (tests/test_[\w]+\.py) -->")
NOT_RUN = "not run by the tests"
# Public names whose docstring is still to be written (issue 50, item 4). The list only shrinks: a name
# that gets a docstring must leave it, and any other public name without one fails the test.
NO_DOCSTRING_YET: set[str] = set()

sys.path.insert(0, str(DOCS / "hooks"))

import art_ray_docs  # noqa: E402


def pages() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if "hooks" not in path.parts)


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line index of the opening fence, language, code) of each top-level fenced block."""
    lines = text.split("\n")
    blocks, index = [], 0
    while index < len(lines):
        opening = re.match(r"^(```+)(\S*)", lines[index])
        if opening:
            end = index + 1
            while end < len(lines) and not lines[end].startswith(opening.group(1)):
                end += 1
            language = opening.group(2).split("{")[0]
            blocks.append((index, language, "\n".join(lines[index + 1 : end])))
            index = end
        index += 1
    return blocks


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strict(site: Path) -> None:
    # every page of docs/ is in the site (a page left out of the nav would be built but unreachable)
    for page in pages():
        relative = page.relative_to(DOCS).with_suffix("")
        built = site / (relative.parent if relative.name == "index" else relative) / "index.html"
        assert built.is_file(), f"{page} was not built"


def test_the_cli_reference_has_every_command(site: Path) -> None:
    html = (site / "reference" / "cli" / "index.html").read_text()
    commands = [prog for prog, _ in art_ray_docs.cli_commands()]
    assert {"art-ray", "art-ray models prepare", "art-ray serve-training", "art-ray keys revoke"} <= {
        *commands
    }
    for prog in commands:
        anchor = prog.replace(" ", "-")
        assert f'id="{anchor}"' in html, f"{prog} is not in the CLI reference"
        assert f"usage: {prog}" in html, f"{prog}'s usage is not in the CLI reference"


def reference_paths() -> list[str]:
    text = (DOCS / "reference" / "api.md").read_text()
    return re.findall(r"^::: ([\w.]+)$", text, flags=re.M)


def public_paths() -> dict[str, str]:
    """name -> module.name of each name in art_ray.__all__, without importing what art_ray loads lazily."""
    import art_ray

    paths = {}
    for name in art_ray.__all__:
        if name in art_ray._ON_FIRST_USE:
            paths[name] = f"{art_ray._ON_FIRST_USE[name]}.{name}"
        else:
            paths[name] = f"{getattr(art_ray, name).__module__}.{name}"
    return paths


def test_the_api_reference_lists_every_public_name() -> None:
    listed = reference_paths()
    assert len(listed) == len(set(listed)), "a name is listed twice"
    expected = set(public_paths().values())
    assert sorted(expected - set(listed)) == [], "public names missing from docs/reference/api.md"
    assert sorted(set(listed) - expected) == [], "names in docs/reference/api.md that art_ray does not export"


def test_public_names_have_docstrings() -> None:
    import griffe

    package = griffe.load("art_ray", search_paths=[str(ROOT)], resolve_aliases=False)
    without = set()
    for name, path in public_paths().items():
        obj = package[path.removeprefix("art_ray.")]
        if obj.docstring is None or not obj.docstring.value.strip():
            without.add(name)
    assert sorted(without - NO_DOCSTRING_YET) == [], "public names without a docstring"
    assert sorted(NO_DOCSTRING_YET - without) == [], (
        "they have docstrings now: take them off NO_DOCSTRING_YET"
    )


def error_classes() -> set[str]:
    """Names of the exception classes art_ray defines (a base named ...Error or ...Exception, or another
    of these), found in the source without importing it."""
    found: dict[str, list[str]] = {}
    for source in (ROOT / "art_ray").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
                found[node.name] = bases
    errors = set()
    changed = True
    while changed:
        changed = False
        for name, bases in found.items():
            if name in errors:
                continue
            if any(base.endswith(("Error", "Exception")) or base in errors for base in bases):
                errors.add(name)
                changed = True
    return errors


def test_troubleshooting_names_every_error_class() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    errors = error_classes()
    assert {"ArtRayError", "PortInUseError", "MemoryPlanError", "PublishError"} <= errors
    missing = sorted(name for name in errors if f"`{name}`" not in text)
    assert missing == [], "error classes without a row in docs/troubleshooting.md"


def test_every_command_on_a_page_is_run_by_a_test_or_marked() -> None:
    problems = []
    for page in pages():
        text = page.read_text()
        lines = text.split("\n")
        page_marked = NOT_RUN in " ".join(text.lower().split()) and "!!! note" in text
        for index, language, _ in fenced_blocks(text):
            where = f"{page.relative_to(ROOT)}:{index + 1}"
            if not language:
                problems.append(f"{where}: a fence without a language (text, python, bash, ...)")
                continue
            if language not in COMMAND_LANGUAGES:
                continue
            before = next((line for line in reversed(lines[:index]) if line.strip()), "")
            tested = RUN_MARKER.fullmatch(before.strip())
            if tested:
                test_file = ROOT / tested.group(1)
                if not test_file.is_file() or page.name not in test_file.read_text():
                    problems.append(f"{where}: {tested.group(1)} does not exist or does not read {page.name}")
            elif not (page_marked or before.strip().startswith(f"<!-- {NOT_RUN}")):
                problems.append(f"{where}: a {language} block neither run by a test nor marked '{NOT_RUN}'")
    assert problems == []


def test_the_quickstart_block_and_the_readme_example_are_the_same_code() -> None:
    quickstart = [(lang, code) for _, lang, code in fenced_blocks((DOCS / "quickstart.md").read_text())]
    readme = [(lang, code) for _, lang, code in fenced_blocks(README.read_text())]
    two_commands = next(block for block in quickstart if block[0] == "bash")
    example = next(block for block in quickstart if block[0] == "python")
    assert "make demo" in two_commands[1] and "make test" in two_commands[1]
    assert two_commands in readme, "README's two commands differ from the quickstart's"
    assert example in readme, "README's example differs from the quickstart's"


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.split("\n")) <= 200
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README links to {target}, which does not exist"


def test_every_headline_figure_names_its_bench_and_date() -> None:
    text = README.read_text()
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"^- (.+?)(?=^- |\Z)", section, flags=re.M | re.S)
    assert len(figures) >= 5
    for figure in figures:
        assert re.search(r"`(bench|tests)/\w+\.py`", figure), f"no bench: {figure}"
        assert re.search(r"20\d\d-\d\d-\d\d", figure), f"no date: {figure}"
    table = (DOCS / "performance" / "index.md").read_text().split("\n")
    rows = [line for line in table if line.startswith("| [")]
    assert len(rows) >= 15
    for row in rows:
        assert re.search(r"\(20\d\d-\d\d-\d\d[^|]*\) \|$", row), f"the latest figure has no date: {row[:80]}"


def test_included_example_readmes_link_into_the_site() -> None:
    text = art_ray_docs.include_example("examples/code_math/README.md", "examples/code_math.md")
    assert "](../learning_curves.png)" in text
    assert "../../docs/" not in text
