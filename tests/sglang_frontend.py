"""Import SGLang's frontend language (`sglang.lang`) without SGLang's GPU runtime.

    from sglang_frontend import sgl   # tests/ is on sys.path under pytest

The test environment installs `sglang` with `--no-deps` plus the few packages its frontend
needs (see docs/agent-apis.md, "SGLang frontend programs"). `sglang/__init__.py` also imports
`sglang.srt.utils.hf_transformers_patches` (monkey-patches on `transformers` for the server
runtime), and that import goes through `sglang.srt.utils`, which pulls in torch, triton, orjson
and the rest of the runtime. When that import fails, and only then, this module registers a
stand-in for that one module whose `apply_all` does nothing, then imports `sglang`. The
frontend's own code (`sglang.lang`) runs unmodified either way.
"""

from __future__ import annotations

import importlib
import sys
import types

PATCHES_MODULE = "sglang.srt.utils.hf_transformers_patches"


def _register_patches_stand_in() -> None:
    stand_in = types.ModuleType(PATCHES_MODULE)
    stand_in.__doc__ = "Stand-in registered by tests/sglang_frontend.py: the runtime is absent."
    stand_in.apply_all = lambda: None
    sys.modules[PATCHES_MODULE] = stand_in


def _forget_partial_import() -> None:
    """A failed `import sglang` leaves half-imported submodules behind without their parent,
    and later imports trip over them; drop them all."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def import_sglang() -> types.ModuleType:
    """Return the `sglang` package, registering the stand-in only if the real module fails."""
    if "sglang" in sys.modules:
        return sys.modules["sglang"]
    _forget_partial_import()
    try:
        importlib.import_module(PATCHES_MODULE)
    except ImportError:
        _forget_partial_import()
        _register_patches_stand_in()
    return importlib.import_module("sglang")


sgl = import_sglang()
