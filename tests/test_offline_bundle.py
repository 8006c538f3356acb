"""tools/offline_bundle.py: the wheels an offline host lacks, installed there with no index.

The end-to-end test fetches from the package index (as `make test`'s own install does): it
bundles for this interpreter with every installed distribution named as present but two, then
installs the bundle with `pip --no-index --no-deps --target` and imports the server from it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from tool_scripts import load_tool

ob = load_tool("offline_bundle")


def test_have_lists_in_the_forms_pip_writes(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("Package    Version\n---------- -------\nJinja2     3.1.4\n"
                       "typing_extensions 4.12\n")
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# a comment\nNumPy==2.1.0\n-e git+https://x/y#egg=z\nzmq @ file:///w\n")
    assert ob.parse_have(f"@{listing}") == {"jinja2", "typing-extensions"}
    assert ob.parse_have(f"@{freeze}") == {"numpy", "zmq"}
    assert ob.parse_have("a, B_c  d.e") == {"a", "b-c", "d-e"}


def test_the_bundle_carries_the_scripts_the_offline_host_runs(tmp_path):
    copied = ob.copy_tools(tmp_path / "tools")
    assert sorted(p.name for p in copied) == sorted(ob.TOOLS)
    assert all(p.read_bytes() == (ob.ROOT / "tools" / p.name).read_bytes() for p in copied)


def test_manylinux_tags_name_every_glibc_up_to_the_hosts():
    tags = ob.manylinux_tags("2.39")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_31_x86_64" in tags
    assert "manylinux_2_5_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_40_x86_64" not in tags
    with pytest.raises(ValueError, match="2.17 or newer"):
        ob.manylinux_tags("2.12")


def test_markers_are_evaluated_for_the_offline_host():
    host = ob.Target("3.12", ("manylinux_2_28_x86_64",)).marker_env()
    assert ob.applies(Requirement("uvloop>=0.19; sys_platform != 'win32'"), host)
    assert not ob.applies(Requirement("tomli; python_version < '3.11'"), host)
    assert not ob.applies(Requirement("pytest; extra == 'test'"), host)  # extras never


def test_requirements_of_a_wheel_follow_the_extras_asked_for(tmp_path):
    """A wheel's Requires-Dist, as the walk reads it: the plain requirements, plus an extra's
    when that extra is asked for; markers for the host."""
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\n"
                    "Version: 1.0\nRequires-Dist: base>=1\n"
                    "Requires-Dist: fast>=2; extra == 'speed'\n"
                    "Requires-Dist: old; python_version < '3.9'\n"
                    "Requires-Dist: docs; extra == 'docs'\n\n")
    host = ob.Target("3.12", ("manylinux_2_28_x86_64",)).marker_env()

    def names(*extras: str) -> list[str]:
        return [r.name for r in ob.requirements_for(wheel, host, frozenset(extras))]

    assert names("") == ["base"]
    assert names("", "speed") == ["base", "fast"]
    assert names("docs") == ["base", "docs"]  # (base again: already fetched, it adds nothing)


@pytest.mark.slow
def test_bundle_installs_offline_and_serves_imports(tmp_path):
    """Two distributions missing on the 'host' (this interpreter, told it has everything
    else): the bundle holds exactly them and sgl-tpu, and the server imports from it alone."""
    missing = {"orjson", "msgspec"}
    have = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    have -= missing | {"sgl-tpu"}
    versions = ob.bundle_wheels(tmp_path / "wheels", have, ob.Target())
    assert set(versions) == missing | {"sgl-tpu"}
    wheels = sorted((tmp_path / "wheels").glob("*.whl"))
    assert {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels} == set(versions)
    project = next(w for w in wheels if w.name.startswith("sgl_tpu-"))
    names = zipfile.ZipFile(project).namelist()  # kernels/ and server/ mapped into the package
    assert "sgl_tpu/server/http_common.py" in names
    assert "sgl_tpu/kernels/csrc/paged_attention_cpu.cpp" in names
    assert not any("__pycache__" in n for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), *map(str, wheels)], check=True)
    probe = ("import msgspec, orjson, sgl_tpu, sgl_tpu.kernels, "
             "sgl_tpu.server.http_common as h; "
             "print(sgl_tpu.__file__, orjson.__file__, msgspec.__file__, h.sse({'a': 1}))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in out[:3]), out
    assert out[3] == "b'data:"
