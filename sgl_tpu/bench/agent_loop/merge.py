"""Merge agent-loop result JSONs into one, e.g. two targets run side by side as two processes,
or one sweep point per process:

    python -m sgl_tpu.bench.agent_loop.merge out.json program.json lpm.json --note "..."

Runs are kept per target and workload label (a later file's run of the same label wins), each
input's `args` under `args["<target>/<label>"]`, and `ratios` are computed again over all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sgl_tpu.bench.agent_loop.__main__ import ratios


def merge(results: list[dict[str, Any]], note: str = "") -> dict[str, Any]:
    merged: dict[str, Any] = {"args": {}, "targets": {}, "workloads": {}, "runs": {},
                              "target_errors": {}}
    for d in results:
        for key in ("targets", "workloads", "target_errors"):
            merged[key].update(d.get(key, {}))
        for target, runs in d.get("runs", {}).items():
            merged["runs"].setdefault(target, {}).update(runs)
            for label in runs:
                merged["args"][f"{target}/{label}"] = d.get("args", {})
    merged["ratios"] = ratios(merged["runs"])
    if note:
        merged["note"] = note
    return merged


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sgl_tpu.bench.agent_loop.merge",
                                description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--note", default="", help="how the inputs were run (kept in the output)")
    args = p.parse_args(argv)
    merged = merge([json.loads(Path(x).read_text()) for x in args.inputs], args.note)
    Path(args.output).write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    main()
