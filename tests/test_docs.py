"""The docs against the code (fast, no server): every flag of the server's `--help` is documented
in docs/ or the README, every relative link of README.md, docs/*.md and benchmarks/results/
README.md resolves to a file of the checkout (and an anchor to a heading of that file), every
result file a doc names exists, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from server_harness import REPO_ROOT

from sgl_tpu.cli import build_parser

DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PAGES = [REPO_ROOT / "README.md", *DOCS, REPO_ROOT / "benchmarks" / "results" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a `[x](y)` there is code, not a link)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = sum(1 for a in found if a == base or re.fullmatch(re.escape(base) + r"-\d+", a))
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_every_server_flag_is_documented():
    text = "\n".join(p.read_text(encoding="utf-8") for p in [REPO_ROOT / "README.md", *DOCS])
    flags = [opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"]
    assert len(flags) > 40  # the parser was read, not an empty stand-in
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert not missing, f"flags of --help that no doc mentions: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists() or not dest.is_relative_to(REPO_ROOT):
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


def test_cited_results_exist():
    """A `benchmarks/results/NAME.json` (or `.png`) a page names is in the checkout (names with
    a `{a,b}` or `*` pattern, and results a command would write anew, are skipped)."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png))", text):
            path = REPO_ROOT / "benchmarks" / "results" / name
            written = re.search(r"--output\s+benchmarks/results/" + re.escape(name), text)
            if not path.exists() and not written:
                missing.append(f"{page.name}: {name}")
    assert not missing, missing


def test_readme_is_short():
    assert len((REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_slug_follows_github():
    overlap = "Overlap scheduling (`--overlap-schedule`)"
    assert slug(overlap) == "overlap-scheduling---overlap-schedule"
    assert slug("Sessions: agent-aware retention") == "sessions-agent-aware-retention"
