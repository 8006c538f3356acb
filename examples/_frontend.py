"""`import sglang` for the DSL examples; with the repository's frontend-only install
(docs/agent-apis.md, "SGLang frontend programs") the GPU runtime is absent and
`tests/sglang_frontend.py` stands in for the one runtime module `sglang/__init__.py` imports."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import sglang as sgl
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from sglang_frontend import sgl  # noqa: F401
