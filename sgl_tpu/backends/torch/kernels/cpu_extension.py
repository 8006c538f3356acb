"""Build and load the compiled CPU kernels: the `torch-cpu-fused` attention backend
(`csrc/paged_attention_cpu.cpp`) and the quantized GEMM with float32 activations
(`csrc/quant_gemm_cpu.cpp`, backends/torch/kernels/quant_gemm_cpu.py), the decoder's fused norm /
RoPE / SwiGLU ops (`csrc/layer_ops_cpu.cpp`, backends/torch/kernels/layer_ops_cpu.py) and the
fixed-reduction-order GEMM of deterministic inference (`csrc/invariant_gemm_cpu.cpp`,
backends/torch/kernels/invariant_gemm_cpu.py).

    python -m sgl_tpu.backends.torch.kernels.cpu_extension   (run by `make install`; prints
                                                              what it built)

Each source is compiled once, at install time, with
`torch.utils.cpp_extension` into `<sys.prefix>/share/sgl-tpu/extensions/` (inside the
virtualenv), never when a server starts. The module's name carries a hash of the source, the
torch and Python versions and (for the `-march=native` build) this CPU's feature flags, so a
server loads only a build of exactly its own source for exactly its machine:

    native    -O3 -march=native   (AVX2 or AVX-512: what this CPU has), tried first
    portable  -O3                 (the compiler's baseline ISA), when the native build fails
    avx2      -march=native -mno-avx512f (and -mno-avxvnni), also built on AVX-512 CPUs: the
              code an AVX2-only CPU runs, loaded instead of the native build when
              SGL_TPU_CPU_KERNELS=avx2 (reproduces an AVX2 host's kernels here; the ISA tests
              run under it)
    avx2vnni  the avx2 flags and AVX-VNNI, quant_gemm_cpu.cpp only (the other sources have no
              AVX-VNNI code: SGL_TPU_CPU_KERNELS=avx2-vnni loads their avx2 builds): the code
              of an AVX2 + AVX-VNNI CPU, built on AVX-512 CPUs that can run it. With -mavxvnni
              where the CPU has AVX-VNNI (VEX `vpdpbusd ymm`); on a CPU with AVX512-VNNI + VL
              but no AVX-VNNI, -DSGL_TPU_VNNI256_EVEX instead: the same 256-bit kernels with
              the EVEX encoding of the same instruction, compiled for that target in those
              functions alone (the VEX one would fault there)

`load_extension(ext)` returns (module, "") or (None, why): missing or unloadable, the caller
falls back (attention `auto` to `torch-sdpa`, float32 quantization to dense weights) and the
reason goes to the log line and to the error of an explicit choice. `load()` /
`why_unavailable()` are the attention extension's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import sgl_tpu.kernels  # the kernel sources (the repository's kernels/, csrc/ inside)

CSRC = Path(sgl_tpu.kernels.__file__).parent / "csrc"
BUILD_DIR = Path(sys.prefix) / "share" / "sgl-tpu" / "extensions"
# Compiler flags per build flavour, tried in order. `-fopenmp` makes the kernels' at::parallel_for
# run on torch's intra-op threads (without it ATen's OpenMP pragma compiles to a serial loop);
# the module then uses the libgomp torch has already loaded. "serial" is for compilers without
# OpenMP. `-fno-trapping-math` (no kernel reads the floating-point exception flags) lets GCC
# turn float compares and float -> int conversions into vector selects and converts (without
# it the SiLU loop of layer_ops_cpu.cpp, whose exp clamps x, stayed scalar). It permits no
# reassociation: results are unchanged.
COMMON_FLAGS = ["-O3", "-ffp-contract=fast", "-fno-trapping-math", "-Wno-psabi"]
FLAVOURS = {
    "native": [*COMMON_FLAGS, "-march=native", "-fopenmp"],
    "portable": [*COMMON_FLAGS, "-fopenmp"],
    "serial": COMMON_FLAGS,
}
# the avx2 build, on CPUs whose native build is AVX-512 (elsewhere the native one is AVX2)
AVX2_FLAGS = [*FLAVOURS["native"], "-mno-avx512f"]
INSTALL_HINT = ("build it with `make install` "
                "(or `python -m sgl_tpu.backends.torch.kernels.cpu_extension`)")
KERNELS_ENV = "SGL_TPU_CPU_KERNELS"  # "avx2" / "avx2-vnni": load those builds (module docstring)
# SGL_TPU_CPU_KERNELS value -> the flavour it loads (a module name's flavour has no "-")
ENV_FLAVOURS = {"avx2": "avx2", "avx2-vnni": "avx2vnni"}


@dataclass(frozen=True, eq=False)
class CpuExtension:
    """One compiled source under csrc/: `prefix` names its modules, `title` its messages.

    Compared and hashed by identity (one object per source: the three below, and each
    baseline a bench compiles): `load_extension`'s cache is looked up on every kernel call,
    and hashing the fields (a Path) cost more than some of the calls."""

    source: Path
    prefix: str
    title: str
    avx_vnni: bool = False  # has AVX-VNNI code of its own (an avx2vnni build)

    def module_name(self, flavour: str) -> str:
        """`<prefix>_<flavour>_<hash>`: one name per source x torch x Python (x CPU)."""
        import torch

        h = hashlib.sha256(self.source.read_bytes())
        h.update(f"{torch.__version__}|{sys.version_info[:2]}|{flavour_flags(flavour)}".encode())
        if flavour in ("native", "avx2", "avx2vnni"):
            h.update(cpu_flags().encode())
        return f"{self.prefix}_{flavour}_{h.hexdigest()[:16]}"

    def built_path(self, flavour: str) -> Path:
        return BUILD_DIR / self.module_name(flavour) / f"{self.module_name(flavour)}.so"

    # What the kernels' Python modules offer their callers (one definition for all of them).
    def available(self) -> bool:
        return load_extension(self)[0] is not None

    def why_unavailable(self) -> str:
        return load_extension(self)[1]

    def simd(self) -> str:
        """The build's vector code: "avx512f", "avx2-fma" or "scalar" ("" unbuilt; None for
        a source that does not say)."""
        module = load_extension(self)[0]
        return "" if module is None else getattr(module, "simd", None)

    def flavour(self) -> str:
        """The build this process loads ("native", "avx2", ...; "" unbuilt), from its name."""
        module = load_extension(self)[0]
        if module is None:
            return ""
        flavour = module.__name__.rsplit("_", 2)[1]
        return {v: k for k, v in ENV_FLAVOURS.items()}.get(flavour, flavour)

    def module(self) -> ModuleType:
        """The loaded module; RuntimeError saying why when it does not load."""
        module, why = load_extension(self)
        if module is None:
            raise RuntimeError(f"{self.title}: {why}")
        return module


ATTENTION = CpuExtension(CSRC / "paged_attention_cpu.cpp", "sgl_tpu_attn_cpu",
                         "fused CPU attention")
QUANT_GEMM = CpuExtension(CSRC / "quant_gemm_cpu.cpp", "sgl_tpu_qgemm_cpu",
                          "quantized CPU GEMM", avx_vnni=True)
LAYER_OPS = CpuExtension(CSRC / "layer_ops_cpu.cpp", "sgl_tpu_layer_ops_cpu",
                         "fused CPU layer ops")
INVARIANT_GEMM = CpuExtension(CSRC / "invariant_gemm_cpu.cpp", "sgl_tpu_inv_gemm_cpu",
                              "fixed-order CPU GEMM")
EXTENSIONS = (ATTENTION, QUANT_GEMM, LAYER_OPS, INVARIANT_GEMM)
SOURCE = ATTENTION.source  # the attention extension's (the module-level functions below)


def flavour_flags(flavour: str) -> list[str]:
    flags = cpu_flags().split()
    if flavour == "avx2":  # an AVX2-only CPU's code: no AVX-VNNI either, where this CPU has it
        return AVX2_FLAGS + (["-mno-avxvnni"] if "avx_vnni" in flags else [])
    if flavour == "avx2vnni":
        return AVX2_FLAGS + (["-mavxvnni"] if "avx_vnni" in flags
                             else ["-DSGL_TPU_VNNI256_EVEX"])
    return FLAVOURS[flavour]


def has_avx2_build() -> bool:
    """Whether `make install` also builds the avx2 flavour (the native build is AVX-512)."""
    return "avx512f" in cpu_flags().split()


def has_avx2_vnni_build() -> bool:
    """Whether `make install` also builds the avx2vnni flavour: the native build is AVX-512 and
    this CPU runs 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI + VL)."""
    flags = set(cpu_flags().split())
    return has_avx2_build() and ("avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags)


def requested_flavours(ext: CpuExtension) -> list[str]:
    """The flavours `load_extension` tries, in order: SGL_TPU_CPU_KERNELS's build where this CPU
    has one (avx2-vnni: the avx2 build of a source without AVX-VNNI code), else native,
    portable, serial."""
    flavour = ENV_FLAVOURS.get(os.environ.get(KERNELS_ENV, ""))
    if flavour == "avx2vnni" and not ext.avx_vnni:
        flavour = "avx2"
    if flavour == "avx2" and has_avx2_build():
        return ["avx2"]
    if flavour == "avx2vnni" and has_avx2_vnni_build():
        return ["avx2vnni"]
    return list(FLAVOURS)


def link_flags(flags: list[str]) -> list[str]:
    """The linker flags a flavour's compiler flags need (OpenMP's runtime)."""
    return [f for f in flags if f == "-fopenmp"]


def cpu_flags() -> str:
    """The CPU's feature flags: /proc/cpuinfo's first `flags` line (else the processor name)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache
def load_extension(ext: CpuExtension) -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why)."""
    try:
        import torch  # noqa: F401  (the extension links against libtorch)
    except ImportError:
        return None, "torch is not installed"
    errors = []
    for flavour in requested_flavours(ext):
        path = ext.built_path(flavour)
        if not path.exists():
            continue
        try:
            spec = importlib.util.spec_from_file_location(ext.module_name(flavour), path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, ""
        except (ImportError, OSError) as e:
            errors.append(f"{path}: {e}")
    if errors:
        return None, f"the compiled {ext.title} failed to load (" + "; ".join(errors) + ")"
    return None, f"the {ext.title} is not built for this source and machine; {INSTALL_HINT}"


def load_flavour(ext: CpuExtension, flavour: str) -> ModuleType | None:
    """One built flavour of `ext` ("native", "avx2", "avx2vnni", ...) whatever
    SGL_TPU_CPU_KERNELS says, beside the one loaded (tests compare them); None when that flavour
    is not built here."""
    path = ext.built_path(flavour)
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(ext.module_name(flavour), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The attention extension's interface (backends/torch/paged_attention.py `fused_*`,
# backends/torch/attention.py).
def module_name(flavour: str) -> str:
    return ATTENTION.module_name(flavour)


def _load() -> tuple[ModuleType | None, str]:
    return load_extension(ATTENTION)


def load() -> ModuleType | None:
    return _load()[0]


def why_unavailable() -> str:
    return _load()[1]


def _build_flavour(ext: CpuExtension, flavour: str, verbose: bool) -> Path:
    """Compile one flavour unless it is built; its path (the compiler's error raises)."""
    from torch.utils import cpp_extension

    path = ext.built_path(flavour)
    if path.exists():
        return path
    # the venv's own ninja (a dependency) when the interpreter's bin dir is not on PATH
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    name, flags = ext.module_name(flavour), flavour_flags(flavour)
    # built in a private directory, renamed into place when complete: a server starting
    # meanwhile never loads a half-written module
    tmp_dir = BUILD_DIR / f".{name}.{os.getpid()}"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=[str(ext.source)], extra_cflags=flags,
                           extra_ldflags=link_flags(flags), build_directory=str(tmp_dir),
                           verbose=verbose)
    except Exception:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    try:
        os.replace(tmp_dir, path.parent)
    except OSError:  # another build of the same source finished first
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if not path.exists():
        raise RuntimeError(f"no {path.name} after the build")
    return path


def build(ext: CpuExtension = ATTENTION, verbose: bool = False) -> Path:
    """Compile (native, else portable, else serial) unless a build of this source exists; its
    path."""
    failures = []
    for flavour in FLAVOURS:
        try:
            return _build_flavour(ext, flavour, verbose)
        except Exception as e:  # a compiler or ninja error: try the next flavour
            failures.append(f"{flavour}: {e}")
    raise RuntimeError(f"building the {ext.title} failed:\n" + "\n".join(failures))


def build_avx2(ext: CpuExtension, verbose: bool = False) -> Path | None:
    """The avx2 flavour on a CPU whose native build is AVX-512 (else None: nothing to add)."""
    return _build_flavour(ext, "avx2", verbose) if has_avx2_build() else None


def build_avx2_vnni(ext: CpuExtension, verbose: bool = False) -> Path | None:
    """The avx2vnni flavour of a source with AVX-VNNI code, where this CPU can run it (else
    None)."""
    return (_build_flavour(ext, "avx2vnni", verbose)
            if ext.avx_vnni and has_avx2_vnni_build() else None)


def build_copy(source: Path, prefix: str, build_dir: str, openmp: bool = True,
               extra_flags: tuple[str, ...] = ()) -> ModuleType:
    """Compile another version of a kernel source (benchmarks' `--baseline-source`) into
    `build_dir` with the native flags (`openmp=False`: without -fopenmp, so its parallel loops
    run on one thread; `extra_flags` after them, e.g. `-mno-avx512f` for the AVX2 code of a
    source on an AVX-512 machine; give such a build its own `prefix`), and load it; no
    caching, no fallback."""
    from torch.utils import cpp_extension

    ext = CpuExtension(Path(source), prefix + ("" if openmp else "_serial"), "baseline")
    flags = [f for f in FLAVOURS["native"] if openmp or f != "-fopenmp"] + list(extra_flags)
    return cpp_extension.load(name=ext.module_name("native"), sources=[str(source)],
                              extra_cflags=flags, extra_ldflags=link_flags(flags),
                              build_directory=build_dir)


def main() -> int:
    fallback = {ATTENTION: "torch-sdpa will be used",
                QUANT_GEMM: "float32 servers keep dense projections",
                LAYER_OPS: "the decoder's norms and RoPE run as torch ops",
                INVARIANT_GEMM: "--enable-deterministic-inference is refused on CPUs"}
    status = 0
    for ext in EXTENSIONS:
        try:
            path = build(ext, verbose="-v" in sys.argv)
        except (ImportError, RuntimeError) as e:
            print(f"sgl-tpu: {ext.title} not built ({e}); {fallback[ext]}", file=sys.stderr)
            status = 1
            continue
        print(f"sgl-tpu: {ext.title} built: {path}")
        for name, builder in (("AVX2", build_avx2), ("AVX2 + AVX-VNNI", build_avx2_vnni)):
            try:
                path = builder(ext, verbose="-v" in sys.argv)
            except Exception as e:  # optional: only SGL_TPU_CPU_KERNELS loads them
                print(f"sgl-tpu: the {name} build of the {ext.title} failed ({e})",
                      file=sys.stderr)
                continue
            if path is not None:
                print(f"sgl-tpu: {ext.title} built for {name} CPUs: {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
