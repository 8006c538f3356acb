"""Build and load the compiled half of the `torch-cpu-fused` attention backend.

    python -m sgl_tpu.kernels.cpu_extension      (run by `make install`; prints what it built)

`csrc/paged_attention_cpu.cpp` is compiled once, at install time, with
`torch.utils.cpp_extension` into `<sys.prefix>/share/sgl-tpu/extensions/` (inside the
virtualenv), never when a server starts. The module's name carries a hash of the source, the
torch and Python versions and (for the `-march=native` build) this CPU's feature flags, so a
server loads only a build of exactly its own source for exactly its machine:

    native    -O3 -march=native   (AVX2 or AVX-512: what this CPU has), tried first
    portable  -O3                 (the compiler's baseline ISA), when the native build fails

`load()` returns the module or None (missing or unloadable: `auto` then falls back to
`torch-sdpa`); `why_unavailable()` says why, for the log line and for the error of an explicit
`--attention-backend torch-cpu-fused`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
BUILD_DIR = Path(sys.prefix) / "share" / "sgl-tpu" / "extensions"
FLAVOURS = {
    "native": ["-O3", "-march=native", "-ffp-contract=fast", "-Wno-psabi"],
    "portable": ["-O3", "-ffp-contract=fast", "-Wno-psabi"],
}
INSTALL_HINT = "build it with `make install` (or `python -m sgl_tpu.kernels.cpu_extension`)"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def module_name(flavour: str) -> str:
    """`sgl_tpu_attn_cpu_<flavour>_<hash>`: one name per source x torch x Python (x CPU)."""
    import torch

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{FLAVOURS[flavour]}".encode())
    if flavour == "native":
        h.update(_cpu_flags().encode())
    return f"sgl_tpu_attn_cpu_{flavour}_{h.hexdigest()[:16]}"


def _built_path(flavour: str) -> Path:
    return BUILD_DIR / module_name(flavour) / f"{module_name(flavour)}.so"


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why)."""
    try:
        import torch  # noqa: F401  (the extension links against libtorch)
    except ImportError:
        return None, "torch is not installed"
    errors = []
    for flavour in FLAVOURS:
        path = _built_path(flavour)
        if not path.exists():
            continue
        try:
            spec = importlib.util.spec_from_file_location(module_name(flavour), path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, ""
        except (ImportError, OSError) as e:
            errors.append(f"{path}: {e}")
    if errors:
        return None, "the compiled fused attention failed to load (" + "; ".join(errors) + ")"
    return None, f"the fused CPU attention is not built for this source and machine; {INSTALL_HINT}"


def load() -> ModuleType | None:
    return _load()[0]


def why_unavailable() -> str:
    return _load()[1]


def build(verbose: bool = False) -> Path:
    """Compile (native, else portable) unless a build of this source exists; its path."""
    from torch.utils import cpp_extension

    # the venv's own ninja (a dependency) when the interpreter's bin dir is not on PATH
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    failures = []
    for flavour, flags in FLAVOURS.items():
        path = _built_path(flavour)
        if path.exists():
            return path
        name = module_name(flavour)
        # built in a private directory, renamed into place when complete: a server starting
        # meanwhile never loads a half-written module
        tmp_dir = BUILD_DIR / f".{name}.{os.getpid()}"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags,
                               build_directory=str(tmp_dir), verbose=verbose)
        except Exception as e:  # a compiler or ninja error: try the next flavour
            shutil.rmtree(tmp_dir, ignore_errors=True)
            failures.append(f"{flavour}: {e}")
            continue
        try:
            os.replace(tmp_dir, path.parent)
        except OSError:  # another build of the same source finished first
            shutil.rmtree(tmp_dir, ignore_errors=True)
        if path.exists():
            return path
        failures.append(f"{flavour}: no {path.name} after the build")
    raise RuntimeError("building the fused CPU attention failed:\n" + "\n".join(failures))


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except (ImportError, RuntimeError) as e:
        print(f"sgl-tpu: fused CPU attention not built ({e}); torch-sdpa will be used",
              file=sys.stderr)
        return 1
    print(f"sgl-tpu: fused CPU attention built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
