"""The docs against the code (fast, no server): every flag of the server's `--help` is documented
in docs/ or the README, docs/serving.md's flag table is the one generated from the settings'
declarations, every relative link of README.md, docs/*.md and benchmarks/results/
README.md resolves to a file of the checkout (and an anchor to a heading of that file), every
result file a doc names exists (by path, bare name or glob), every `python -m sgl_tpu...` of a
doc runs a module of the checkout, and the README stays short."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import REPO_ROOT

from sgl_tpu.cli import TABLE_END, TABLE_START, build_parser, markdown_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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


def test_flag_table_is_generated_from_the_declarations():
    """The table lists every flag of `--help` once, in its order, with the default, choices and
    help text its declaration gives (`markdown_table`, from the `ServerArgs` fields)."""
    text = (REPO_ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    table = text.split(TABLE_START + "\n")[1].split(TABLE_END)[0]
    assert table == markdown_table(), \
        "the flag table is stale: run python -m sgl_tpu.cli --markdown docs/serving.md"
    flags = [a.option_strings[-1] for a in build_parser()._actions
             if a.option_strings[-1] != "--help"]
    assert re.findall(r"^\| `(--[\w-]+)` \|", table, flags=re.M) == flags
    actions = {a.option_strings[-1]: a for a in build_parser()._actions}
    assert "| `--page-size` | `16` | " + actions["--page-size"].help + " | " in table
    assert "| `--dtype` | `auto` | {auto, float32, bfloat16}: " in table


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


RESULTS = REPO_ROOT / "benchmarks" / "results"
# a result name: word characters and `-`, globs `*` and `{a,b}`, an optional extension
RESULT_NAME = re.compile(r"([\w*{},-]+?)(\.json|\.png|\.\{json,png\})?")
CITATION = re.compile(r"`([^`\s]+)`|benchmarks/results/([\w.*{},-]*[\w*}])")


def _expand(pattern: str) -> list[str]:
    """`a_{b,c}` -> [a_b, a_c]."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [out for alt in m.group(1).split(",")
            for out in _expand(pattern[: m.start()] + alt + pattern[m.end():])]


def cited_results(text: str, stems: set[str]) -> list[str]:
    """The result names a page cites: every `benchmarks/results/NAME`, and every backticked
    NAME whose first two `_` words are those of a result file (`agent_loop_...`, `speed2_amx_...`,
    globs included) and that has an extension or at least three words (so `omp_wait`, a
    /server_info key, is not one)."""
    families = {"_".join(stem.split("_")[:2]) for stem in stems}
    names = []
    for ticked, path in CITATION.findall(text):
        m = RESULT_NAME.fullmatch(ticked.removeprefix("benchmarks/results/") or path)
        if m is None:
            continue
        stem, ext = m.groups()
        family = "_".join(stem.split("_")[:2])
        if path or ticked.startswith("benchmarks/results/") or (
                any(fnmatch.fnmatchcase(f, family) for f in families)
                and (ext or stem.count("_") >= 2)):
            names.append(m.group(0))
    return names


def test_cited_results_exist():
    """Every result name a page cites (cited_results: with or without `benchmarks/results/`
    and an extension; a glob matches at least one file) is a file of benchmarks/results/, or
    one a command of the page writes anew (`--output benchmarks/results/NAME`)."""
    files = sorted(p.name for p in RESULTS.iterdir() if p.suffix in (".json", ".png"))
    stems = {name.rsplit(".", 1)[0] for name in files}
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for name in cited_results(text, stems):
            stem = RESULT_NAME.fullmatch(name).group(1)
            if any(fnmatch.fnmatchcase(f, pattern) or fnmatch.fnmatchcase(f, pattern + ".*")
                   for pattern in _expand(name) + _expand(stem) for f in files):
                continue
            if re.search(r"--output\s+benchmarks/results/" + re.escape(name), text):
                continue
            missing.append(f"{page.relative_to(REPO_ROOT)}: {name}")
    assert not missing, f"result files the docs cite that are not in benchmarks/results/: {missing}"


# (not a placeholder such as `python -m sgl_tpu.bench.<name>`)
def test_cited_results_rule():
    stems = {"agent_loop_peer_avx2_bf16kv", "omp_wait_b1", "speed2_amx_acceptance_c8_react"}
    text = ("`agent_loop_peer_avx512_gemm_r1` `omp_wait` `speed2_amx_acceptance_*.json` "
            "`tokenizer_config.json` `memory.kv_cache_dtype` `agent_loop_x.{json,png}` "
            "(benchmarks/results/tp_cpu.json)")
    assert cited_results(text, stems) == [
        "agent_loop_peer_avx512_gemm_r1", "speed2_amx_acceptance_*.json",
        "agent_loop_x.{json,png}", "tp_cpu.json"]


MODULE = re.compile(r"python[\d.]*\s+-m\s+(sgl_tpu(?:\.\w+)*)(?!\w|\.[<\w.])")
ROW_COMMIT = re.compile(r"\|\s*([0-9a-f]{7,40})\s*\|\s*$")


def module_file(module: str) -> Path | None:
    """The file `python -m module` runs in this checkout (pyproject.toml's package-dir maps
    `sgl_tpu.kernels` to kernels/ and `sgl_tpu.server` to server/), or None."""
    dirs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "tool"]["setuptools"]["package-dir"]
    package = max((p for p in dirs if module == p or module.startswith(p + ".")), key=len)
    base, rest = REPO_ROOT / dirs[package], module[len(package):].split(".")[1:]
    candidates = [base.joinpath(*rest).with_suffix(".py")] if rest else []
    candidates.append(base.joinpath(*rest, "__main__.py"))
    return next((path for path in candidates if path.is_file()), None)


def _existed_at(commit: str, module: str) -> bool:
    """Whether `module` was a bench file at `commit` (a results README row's commit)."""
    path = "/".join(module.split("."))
    return any(subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}{tail}"],
                              cwd=REPO_ROOT, capture_output=True).returncode == 0
               for tail in (".py", "/__main__.py"))


def test_doc_commands_name_modules_of_the_checkout():
    """Every `python -m sgl_tpu...` of README.md and docs/*.md (fenced blocks included) runs a
    module file of this checkout. A benchmarks/results/README.md row records the command at
    its commit: its module is in the checkout, or was at that commit (git)."""
    has_git = shutil.which("git") is not None and (REPO_ROOT / ".git").exists()
    stale = []
    for page in PAGES:
        for line in page.read_text(encoding="utf-8").replace("-m\n", "-m ").splitlines():
            for module in MODULE.findall(line):
                if module_file(module) is not None:
                    continue
                row = ROW_COMMIT.search(line) if page.name == "README.md" \
                    and page.parent == RESULTS else None
                if row and (not has_git or _existed_at(row.group(1), module)):
                    continue
                stale.append(f"{page.relative_to(REPO_ROOT)}: {module}")
    assert not stale, f"doc commands whose module is not in the checkout: {sorted(set(stale))}"


def test_readme_is_short():
    assert len((REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_slug_follows_github():
    overlap = "Overlap scheduling (`--overlap-schedule`)"
    assert slug(overlap) == "overlap-scheduling---overlap-schedule"
    assert slug("Sessions: agent-aware retention") == "sessions-agent-aware-retention"
