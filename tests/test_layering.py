"""The package's layering, read from the source (every import statement, top-level or inside a
function, of every module):

    sgl_tpu/backends/jax/     the JAX home: the only code that imports jax / jaxlib / flax
    sgl_tpu/backends/torch/   the torch home: the only code that imports torch
    kernels/ (sgl_tpu.kernels) kernel sources, each written for one framework (it imports that
                              one only) and never importing a home, not even by module name;
                              a home imports only its own framework's kernels
    everything else           the neutral core (scheduler, cache, step contract, registries,
                              server, loaders, benchmarks): imports neither framework nor a home,
                              and reaches a backend only through a registry, by module name

The import graph of sgl_tpu has no cycles, and each backend's attention path (registry ->
kernel) runs through at most two Python files (`test_each_backend_attention_path`).
`python -m pytest tests/test_layering.py -s` prints what it found.
"""

from __future__ import annotations

import ast
from pathlib import Path

from server_harness import REPO_ROOT

FRAMEWORKS = {"jax": ("jax", "jaxlib", "flax"), "torch": ("torch",)}
HOMES = {"jax": "sgl_tpu.backends.jax", "torch": "sgl_tpu.backends.torch"}
# the installed package's folders (pyproject.toml's package-dir): module prefix -> folder
ROOTS = {"sgl_tpu.kernels": REPO_ROOT / "kernels", "sgl_tpu.server": REPO_ROOT / "server",
         "sgl_tpu": REPO_ROOT / "sgl_tpu"}


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file."""
    out = {}
    for prefix, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "sgl_tpu" and parts[:1] in (["kernels"], ["server"]):
                continue
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The dotted names a module imports (`from a import b` gives a.b when that is a module of
    the package, else a), relative imports resolved."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return out


IMPORTS = {name: _imports(name) for name in MODULES}


def _framework_of(imported: str) -> str | None:
    top = imported.split(".")[0]
    return next((fw for fw, tops in FRAMEWORKS.items() if top in tops), None)


def _home_of(module: str) -> str | None:
    return next((fw for fw, home in HOMES.items()
                 if module == home or module.startswith(home + ".")), None)


def _kernel_framework(module: str) -> str | None:
    """A kernel source's framework (the one it imports), None for neutral kernel modules."""
    if not module.startswith("sgl_tpu.kernels"):
        return None
    used = {_framework_of(i) for i in IMPORTS[module]} - {None}
    return used.pop() if len(used) == 1 else None


def test_only_the_homes_and_their_kernels_import_a_framework():
    found = []
    for name in sorted(MODULES):
        used = {_framework_of(i) for i in IMPORTS[name]} - {None}
        allowed = {_home_of(name)}
        if name.startswith("sgl_tpu.kernels"):
            assert len(used) <= 1, f"{name} imports {sorted(used)}: a kernel is one framework's"
            allowed |= used
        if used - allowed:
            found.append(f"{name}: {sorted(used - allowed)}")
        if used:
            print(f"{name}: {', '.join(sorted(used))}")
    assert not found, "framework imports outside their home:\n" + "\n".join(found)


def test_the_homes_never_import_each_other_nor_the_other_frameworks_kernels():
    found = []
    for name in sorted(MODULES):
        home = _home_of(name)
        if home is None:
            continue
        for imported in IMPORTS[name]:
            other = _home_of(imported) or _kernel_framework(imported)
            if other is not None and other != home:
                found.append(f"{name} -> {imported}")
    assert not found, "\n".join(found)


def test_the_core_imports_no_backend():
    """A neutral module reaches a home or a framework's kernel through a registry's module
    name (importlib), never an import statement."""
    found = []
    for name in sorted(MODULES):
        if _home_of(name) is not None or _kernel_framework(name) is not None:
            continue
        for imported in IMPORTS[name]:
            if _home_of(imported) is not None or _kernel_framework(imported) is not None:
                found.append(f"{name} -> {imported}")
    assert not found, "\n".join(found)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan) in the package's import
    graph."""
    graph = {name: sorted(i for i in IMPORTS[name] if i in MODULES and i != name)
             for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycles():
    cycles = _cycles()
    for c in cycles:
        print("cycle:", " <-> ".join(c))
    assert not cycles


def test_kernels_never_import_a_home():
    """kernels/ is imported by the homes, never the other way: no import statement and no
    module-name string (an importlib target) of sgl_tpu.backends."""
    found = []
    for name in sorted(MODULES):
        if not name.startswith("sgl_tpu.kernels"):
            continue
        found += [f"{name} imports {i}" for i in sorted(IMPORTS[name]) if _home_of(i)]
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    "sgl_tpu.backends" in node.value:
                found.append(f"{name} names {node.value!r} (line {node.lineno})")
    assert not found, "kernels/ reaches into a home:\n" + "\n".join(found)


# The attention interface: a module defining one of these (at top level) holds attention code.
ATTENTION_FUNCTIONS = ("write_kv", "extend_attention", "decode_attention")
# Where a backend's kernels are Python modules, the path ends there: the JAX backend's are in
# kernels/ (the jax.numpy references, the Pallas kernel). The torch backend's kernels are
# compiled (C++ in kernels/csrc), so every Python module on its path lies before the kernel.
PYTHON_KERNELS = {"jax": "sgl_tpu.kernels", "torch": None}
MAX_ATTENTION_FILES = 2


def _defines_attention(name: str) -> bool:
    tree = ast.parse(MODULES[name].read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name.endswith(ATTENTION_FUNCTIONS)
               for node in tree.body)


def _attention_path(framework: str) -> tuple[str, list[str], list[str]]:
    """The backend's attention entry (the module the registry loads its names from), the
    Python files between the registry and the kernel (the entry, then every module it reaches
    through imports, inside the home or kernels/, that holds attention code, kernel modules
    excepted), and the Python kernel modules reached."""
    entry = f"{HOMES[framework]}.attention"
    kernels = PYTHON_KERNELS[framework]
    seen, todo, path, reached = {entry}, [entry], [entry], []
    while todo:
        for imported in sorted(IMPORTS[todo.pop(0)]):
            if imported in seen or imported not in MODULES:
                continue
            seen.add(imported)
            if kernels and imported.startswith(kernels):
                reached.append(imported)
            elif _home_of(imported) == framework or imported.startswith("sgl_tpu.kernels"):
                todo.append(imported)
                if _defines_attention(imported):
                    path.append(imported)
    return entry, path, reached


def test_each_backend_attention_path():
    """For every executor backend of the attention registry: its attention lives in its home,
    the entry defines every loader the registry names, and between the registry and the kernel
    lie at most MAX_ATTENTION_FILES Python files."""
    from sgl_tpu.executor.attention_registry import ATTENTION_BACKENDS

    found = []
    for framework in sorted({spec.framework for spec in ATTENTION_BACKENDS.values()}):
        entry, path, reached = _attention_path(framework)
        assert entry in MODULES, f"{framework}: no attention module {entry}"
        defined = {node.name for node in ast.parse(MODULES[entry].read_text()).body
                   if isinstance(node, ast.FunctionDef)}
        for name, spec in ATTENTION_BACKENDS.items():
            if spec.framework == framework and spec.loader not in defined:
                found.append(f"{name}: {entry} has no loader {spec.loader}")
        kernel = ", ".join(reached) if reached else "compiled (kernels/csrc)"
        print(f"{framework}: registry -> {' -> '.join(path)} -> kernel: {kernel}")
        outside = [m for m in path if _home_of(m) != framework]
        if outside:
            found.append(f"{framework}: attention code outside its home: {', '.join(outside)}")
        if len(path) > MAX_ATTENTION_FILES:
            found.append(f"{framework}: {len(path)} files between the registry and the kernel "
                         f"(at most {MAX_ATTENTION_FILES}): {', '.join(path)}")
    assert not found, "\n".join(found)
