"""What a host without network needs to serve and time sgl-tpu, fetched on a host with one: this
checkout as a wheel, the wheels of every runtime dependency the offline host lacks (for its
Python and platform), and the default model's shape files.

    python tools/offline_bundle.py DIR [--have NAMES | --have @FILE]
        [--python-version 3.12 (--glibc 2.39 | --platform manylinux_2_28_x86_64 ...)]
        [--no-model]

    DIR/wheels/  sgl_tpu-*.whl (built from this checkout: kernels/ and server/ inside it as
                 sgl_tpu.kernels and sgl_tpu.server), then, breadth first from its
                 Requires-Dist: each requirement whose marker holds on the offline host (for
                 the extras its requirer asked for) and that --have does not name, one
                 `pip download --no-deps` wheel each (binary only), and in turn that wheel's
                 requirements (with those of every extra asked of it)
    DIR/model/   `random_checkpoint.py shape` of the default model (config, tokenizer; no
                 weights)
    DIR/tools/   the scripts of this folder the offline host runs (TOOLS)

--have names the distributions the offline host already has (commas or whitespace between
names; `@FILE` reads them from a file, one per line, as `pip list` or `pip freeze` writes
them: the first word, up to `==`). Their versions are not checked; what only they require is
not fetched. Two requirements of one distribution that the fetched version cannot both meet
stop the bundle with both named. Without --python-version / --platform the wheels are for this
interpreter and machine; --glibc names every x86-64 manylinux tag up to the host's glibc (pip
matches platform tags exactly).

There (no index, no resolver: the bundle is the resolution; cwd must not hold an `sgl_tpu`
folder, which would shadow the installed one):

    python3 -m pip install --no-index --no-deps --target /tmp/site DIR/wheels/*.whl
    export PYTHONPATH=/tmp/site
    python3 DIR/tools/random_checkpoint.py weights DIR/model
    python3 -m sgl_tpu.bench.accelerator --model-path DIR/model --out-dir RESULTS \
        --tools-dir DIR/tools
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

PROJECT = "sgl-tpu"
SOURCES = ("pyproject.toml", "README.md", "sgl_tpu", "kernels", "server")  # what a build reads
ROOT = Path(__file__).resolve().parents[1]  # the checkout this script belongs to
# run there: random weights for DIR/model, and the accelerator bench's profile and host parts
TOOLS = ("random_checkpoint.py", "jax_step_profile.py", "torch_profile.py")


@dataclass(frozen=True)
class Target:
    """The offline host: its Python (`3.12`) and pip platform tags; None = this machine's."""

    python_version: str | None = None
    platforms: tuple[str, ...] = ()

    def marker_env(self) -> dict[str, str]:
        """Marker variables of the offline host (Linux x86-64 CPython when a target is named)."""
        env = dict(default_environment())
        if self.python_version is not None:
            env.update(python_version=self.python_version,
                       python_full_version=self.python_version + ".0",
                       implementation_name="cpython", platform_python_implementation="CPython",
                       sys_platform="linux", platform_system="Linux", os_name="posix",
                       platform_machine="x86_64")
        return env

    def pip_flags(self) -> list[str]:
        flags = ["--only-binary=:all:"]
        if self.python_version is not None:
            flags += ["--python-version", self.python_version, "--implementation", "cp"]
        for tag in self.platforms:
            flags += ["--platform", tag]
        return flags


def manylinux_tags(glibc: str, arch: str = "x86_64") -> list[str]:
    """pip platform tags of every manylinux wheel a host with this glibc runs (pip matches a
    tag exactly, so each glibc minor up to the host's is named), newest first."""
    major, minor = (int(x) for x in glibc.split(".")[:2])
    if major != 2 or minor < 17:
        raise ValueError(f"glibc {glibc}: expected 2.17 or newer")
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def parse_have(spec: str) -> set[str]:
    """`a,b c` or `@FILE` (lines as `pip list` / `pip freeze` write them: the first word, up
    to `==`) -> canonical names."""
    if not spec.startswith("@"):
        return {canonicalize_name(n) for n in spec.replace(",", " ").split()}
    names = set()
    for line in Path(spec[1:]).read_text(encoding="utf-8").splitlines():
        words = line.split()
        if not words or words[0].startswith(("#", "-")):
            continue  # blank, comment, option (`-e ...`), the dashes under `pip list`'s header
        name = words[0].split("==")[0]
        if name.lower() != "package":  # `pip list`'s header
            names.add(canonicalize_name(name))
    return names


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """Requires-Dist of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8")
    return [Requirement(r) for r in Parser().parsestr(text).get_all("Requires-Dist") or []]


def applies(req: Requirement, env: dict[str, str], extras: frozenset[str] = frozenset({""})
            ) -> bool:
    """The requirement holds on the host when its distribution is installed with `extras`
    ("" = a plain install)."""
    return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras)


def requirements_for(wheel: Path, env: dict[str, str], extras: frozenset[str]
                     ) -> list[Requirement]:
    """What the wheel's distribution needs on the host when installed with `extras`."""
    return [r for r in wheel_requirements(wheel) if applies(r, env, extras)]


def build_project_wheel(out: Path) -> Path:
    """This checkout (the folder holding pyproject.toml and this tools/ folder) as a wheel
    in `out`, built with the installed setuptools (no build isolation: no index needed) from a
    fresh copy of its sources (an in-tree build/ would keep files since deleted)."""
    root = ROOT
    if not (root / "pyproject.toml").is_file():
        raise SystemExit(f"{root} holds no pyproject.toml: build the bundle from a checkout "
                         "of sgl-tpu (an editable install)")
    with tempfile.TemporaryDirectory() as tmp:
        src, dist = Path(tmp, "src"), Path(tmp, "dist")
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        src.mkdir()
        for name in SOURCES:
            if (root / name).is_dir():
                shutil.copytree(root / name, src / name, ignore=skip)
            else:
                shutil.copy2(root / name, src / name)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                               "--no-build-isolation", "--wheel-dir", str(dist), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"building the sgl-tpu wheel failed:\n{proc.stderr.strip()}")
        (built,) = dist.glob("*.whl")
        return Path(shutil.move(str(built), out / built.name))


def download(req: Requirement, target: Target, out: Path) -> Path:
    """One wheel of `req` for the target, its requirements not followed; -> its path."""
    spec = f"{req.name}{req.specifier}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               *target.pip_flags(), "--dest", tmp, spec],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SystemExit(f"no wheel of {spec} for the target "
                             f"({' '.join(target.pip_flags())}):\n{proc.stderr.strip()}")
        return Path(shutil.move(str(wheels[0]), out / wheels[0].name))


def bundle_wheels(out: Path, have: set[str], target: Target) -> dict[str, str]:
    """DIR/wheels: the project's wheel and the closure of its requirements less `have`;
    -> {canonical name: version} of every wheel written."""
    out.mkdir(parents=True, exist_ok=True)
    env = target.marker_env()
    project = build_project_wheel(out)
    plain = frozenset({""})
    versions = {canonicalize_name(PROJECT): str(parse_wheel_filename(project.name)[1])}
    wheels: dict[str, Path] = {}  # name -> its fetched wheel
    walked: dict[str, frozenset[str]] = {}  # name -> the extras whose requirements are queued
    wanted_by: dict[str, str] = {}  # name -> the requirement that fetched it (for conflicts)
    queue = deque((PROJECT, r) for r in requirements_for(project, env, plain))
    while queue:
        parent, req = queue.popleft()  # its marker holds on the host
        name = canonicalize_name(req.name)
        if name in have:
            continue
        if name not in wheels:
            wheels[name] = download(req, target, out)
            versions[name] = str(parse_wheel_filename(wheels[name].name)[1])
            wanted_by[name], walked[name] = f"{parent} ({req})", frozenset()
        elif not req.specifier.contains(Version(versions[name]), prereleases=True):
            raise SystemExit(f"{parent} needs {req.name}{req.specifier}, but "
                             f"{wanted_by[name]} fetched {req.name} {versions[name]}")
        extras = (plain | set(req.extras)) - walked[name]  # a new extra adds requirements
        if extras:
            walked[name] |= extras
            queue.extend((f"{req.name} {versions[name]}", r)
                          for r in requirements_for(wheels[name], env, extras))
    return versions


def copy_tools(out: Path) -> list[Path]:
    """DIR/tools: the TOOLS scripts of this checkout; -> their paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(ROOT / "tools" / name, out / name)) for name in TOOLS]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--have", default="", help="distributions the offline host has: names "
                   "(commas or spaces between) or @FILE (pip list / pip freeze output)")
    p.add_argument("--python-version", default=None, help="the host's Python, e.g. 3.12 "
                   "(default: this interpreter)")
    p.add_argument("--platform", action="append", default=[],
                   help="a pip platform tag of the host (repeat for several; default: this "
                   "machine's)")
    p.add_argument("--glibc", default=None, help="the host's glibc, e.g. 2.39: adds every "
                   "x86-64 manylinux platform tag it can run (with --python-version)")
    p.add_argument("--no-model", action="store_true", help="no DIR/model shape files")
    args = p.parse_args(argv)
    if args.glibc:
        args.platform += manylinux_tags(args.glibc)
    if bool(args.python_version) != bool(args.platform):
        p.error("--python-version and --platform go together (pip needs both for another "
                "host)")
    out = Path(args.out_dir)
    have = parse_have(args.have)
    target = Target(args.python_version, tuple(args.platform))
    versions = bundle_wheels(out / "wheels", have, target)
    print(f"{out / 'wheels'}: {len(versions)} wheels "
          f"({', '.join(f'{n} {v}' for n, v in sorted(versions.items()))}) for Python "
          f"{args.python_version or platform.python_version()}")
    copy_tools(out / "tools")
    if not args.no_model:
        from random_checkpoint import write_shape  # this folder's script (first on sys.path)

        print(write_shape(out / "model"))


if __name__ == "__main__":
    main()
