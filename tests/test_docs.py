"""The documentation site builds with no warning and no broken link; the README stays short and its links resolve.

`make docs` is `mkdocs build --strict`; this test runs the same build into a temporary directory, so `make test`
(and CI) fails on a broken link or anchor, a page missing from the nav, or a reference page the hooks cannot
generate. It also checks what mkdocs cannot see: paths named in code spans and code blocks must exist in the
repository, and no page may point at the design notes that live outside it. Nor may the code: its comments
and docstrings cite the papers, or the pages of this site as docs/<page>.md#anchor, and every such page and
anchor must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# top-level names of the repository that a page may name as a path (`fairgate/proxy/config.py`, `bench/…`)
TOP = ("fairgate/", "bench/", "tests/", "scripts/", "docs/", ".ci/")
OUTSIDE = re.compile(r"notes/[\w.-]+\.md|\.\./shared|ARCHITECTURE\.md|\bthe note\b|\bnote's\b")
# the code, tests, benchmarks and scripts, whose comments and docstrings cite documentation
SOURCES = sorted(p for top in ("fairgate", "tests", "bench", "scripts") for p in (ROOT / top).rglob("*")
                 if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".yml", ".toml"))
DOCS_REF = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the docs extra is not installed ({e}): pip install -e '.[docs]' (make venv does)")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a build warning
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    return run, site


def test_site_builds_strict_with_no_warning(build):
    run, site = build
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    warnings = [line for line in out.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    assert (site / "index.html").is_file()


def test_generated_references_are_in_the_site(build):
    from dataclasses import fields

    from fairgate.proxy.config import GatewayConfig

    _, site = build
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("fairgate serve", "fairgate admin key create", "fairgate usage summary", "fairgate db upgrade",
                    "fairgate simulate"):
        assert command in cli, command
    config = (site / "reference" / "configuration" / "index.html").read_text()
    for f in fields(GatewayConfig):
        assert f"<code>{f.name}</code>" in config, f.name
    assert "fairgate_tenant_counter" in (site / "reference" / "metrics" / "index.html").read_text()


def test_no_built_page_points_outside_the_repository(build):
    """Generated pages included: the code's comments and help texts may cite the design notes kept outside."""
    _, site = build
    hits = {str(p.relative_to(site)): OUTSIDE.search(p.read_text())[0]
            for p in site.rglob("*.html") if OUTSIDE.search(p.read_text())}
    assert not hits, hits


def _docs_refs() -> dict[tuple[str, str | None], list[str]]:
    """Every docs/<page>.md[#anchor] the sources name: (page, anchor) -> where."""
    refs: dict[tuple[str, str | None], list[str]] = {}
    for path in SOURCES:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in DOCS_REF.finditer(line):
                refs.setdefault((m[1], m[2]), []).append(f"{path.relative_to(ROOT)}:{n}")
    return refs


def test_the_code_cites_nothing_outside_the_repository():
    """The algorithms' notes that the code once cited live outside the repository; what they said is in the
    docs now, and comments point there (or at the papers)."""
    hits = [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for path in SOURCES
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if (m := OUTSIDE.search(line))]
    assert SOURCES and not hits, "\n".join(hits)


def test_the_docs_cite_nothing_outside_the_repository():
    """Nor do the pages (the changelog aside: it is history)."""
    pages = [p for p in (ROOT / "docs").rglob("*.md") if p.name != "changelog.md"] + [ROOT / "README.md"]
    hits = [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for path in pages
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if (m := OUTSIDE.search(line))]
    assert not hits, "\n".join(hits)


def test_the_docs_pages_the_code_cites_exist():
    refs = _docs_refs()
    assert refs  # the code does cite the docs; an empty scan would mean the pattern broke
    missing = {f"docs/{page}": where for (page, _), where in refs.items()
               if not (ROOT / "docs" / page).is_file()}
    assert not missing, missing


def test_the_anchors_the_code_cites_exist(build):
    """docs/<page>.md#anchor: the built page (<page>/index.html; for an index.md, index.html in its folder)
    has that id."""
    _, site = build
    missing = {}
    for (page, anchor), where in _docs_refs().items():
        if anchor is None or not (ROOT / "docs" / page).is_file():
            continue  # a missing page is the test above's
        stem = page[:-len(".md")]
        index = stem == "index" or stem.endswith("/index")
        html = site / (stem[:-len("index")] if index else stem + "/") / "index.html"
        has_id = re.compile(rf"""\bid=["']?{re.escape(anchor)}["'\s>]""")
        if not html.is_file() or not has_id.search(html.read_text()):
            missing[f"docs/{page}#{anchor}"] = where
    assert not missing, missing


def test_readme_is_under_8_kib():
    size = README.stat().st_size
    assert size < 8192, f"README.md is {size} bytes"


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text) + re.findall(r"<img[^>]+src=\"([^\"]+)\"", text)


def test_readme_links_resolve():
    broken = []
    for target in _links(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, broken


def _code_words(text: str):
    """Every word inside inline code and fenced code blocks."""
    blocks = re.findall(r"^```.*?^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", rest)
    for chunk in blocks + spans:
        yield from re.split(r"[\s=,;()\[\]{}'\"<>|]+", chunk)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_by_a_page_exist(page):
    text = page.read_text()
    assert not OUTSIDE.search(text), f"{page.name} points outside the repository: {OUTSIDE.search(text)[0]}"
    missing = set()
    for word in _code_words(text):
        word = word.split("::")[0].rstrip(".:…")
        if word.startswith("../") or not word.startswith(TOP) or "*" in word:
            continue
        if not (ROOT / word).exists():
            missing.add(word)
    assert not missing, f"{page.relative_to(ROOT)} names paths the repository does not have: {sorted(missing)}"
