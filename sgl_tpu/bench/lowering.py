"""The JAX runner's jitted steps lowered for a TPU (or a GPU) on this host, without the chips: a
report per (model, platform, TP) of each program's custom calls, host callbacks, collectives,
shape buckets and bytes per chip (the lowering itself: sgl_tpu/backends/jax/lowering.py).

    python -m sgl_tpu.bench.lowering --lower tpu,cuda --tp-size 1,4,8 \\
        [--model-path X] [--model-config CONFIG_JSON_OR_DIR ...] --output FILE
    python -m sgl_tpu.bench.lowering --plan REPORT

(`python -m sgl_tpu.bench.accelerator --lower ...` runs the first as its own process.)
`--plan` prints the HBM plan table (`hbm_plan`) of the TPU entries of a report's last model.
The JAX module is reached by name (LOWERING), after XLA_FLAGS asks for the host devices the
partitioned compiles need.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

LOWERING = "sgl_tpu.backends.jax.lowering"  # the JAX home's module, imported by name
HBM_GIB = {"v5e": 16, "v6e": 32, "v7x": 96}
RUNTIME_RESERVE_BYTES = 1 << 30  # per chip: XLA runtime, program code, fragmentation


def model_config(model_path: str | None, config_json: str | None):
    """ModelConfig from a config.json alone (`config_json`), or from the model at `model_path`
    (None: the default model)."""
    if config_json is not None:
        from sgl_tpu.loader.hf_loader import config_from_hf

        path = Path(config_json)
        if path.is_dir():
            path = path / "config.json"
        return config_from_hf(json.loads(path.read_text()), {}, set(), str(path))
    from sgl_tpu.loader import load_model

    return load_model(model_path).config



# ---- the HBM plan --------------------------------------------------------------------------------
def hbm_plan(setups: dict[str, dict[str, Any]], contexts=(4096, 32768)) -> list[dict[str, Any]]:
    """Per chip kind and TP (`setups`: "tpu tp=N" -> lower_setup's entry): the largest KV pool
    in tokens once weights, the largest activation and RUNTIME_RESERVE_BYTES are set aside, the
    largest decode batch at each context, and the --mem-fraction-static that pool means."""
    rows = []
    for chip, gib in HBM_GIB.items():
        hbm = gib << 30
        for key, e in setups.items():
            if "error" in e:
                continue
            tp = int(key.split("tp=")[1])
            fixed = e["weights_bytes_per_chip"] + e["largest_activation_bytes_per_chip"]
            free = hbm - fixed - RUNTIME_RESERVE_BYTES
            tokens = max(0, free // e["kv_bytes_per_token_per_chip"])
            tokens -= tokens % 16
            row = {"chip": chip, "hbm_gib": gib, "tp": tp,
                   "weights_gib": round(e["weights_bytes_per_chip"] / 2**30, 2),
                   "activation_gib": round(e["largest_activation_bytes_per_chip"] / 2**30, 2),
                   "kv_tokens": int(tokens)}
            for c in contexts:
                row[f"decode_batch_{c // 1024}k"] = int(tokens // c)
            kv = tokens * e["kv_bytes_per_token_per_chip"]
            row["mem_fraction_static"] = (round((e["weights_bytes_per_chip"] + kv) / hbm, 2)
                                          if tokens else "does not fit")
            rows.append(row)
    return rows


def default_mem_fraction(rows: list[dict[str, Any]]) -> float:
    """The largest multiple of 0.05 at or under every fitting row's fraction: a default that
    leaves each chip and TP of the plan its activations and runtime reserve."""
    fractions = [r["mem_fraction_static"] for r in rows if r["kv_tokens"]]
    return int(min(fractions) * 20) / 20


def plan_markdown(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ---- command -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the JAX runner's jitted steps lowered for TPU / "
                                            "CUDA on this host, or the HBM plan of a report")
    p.add_argument("--lower", default="tpu", help="platforms: tpu, cuda")
    p.add_argument("--model-path", default=None)
    p.add_argument("--model-config", action="append", default=[],
                   help="a config.json (or its folder) of a model lowered from its config alone; "
                        "repeatable")
    p.add_argument("--tp-size", default="1", help="TP sizes, e.g. 1,4,8")
    p.add_argument("--cuda-tp-size", default="1", help="TP sizes lowered for cuda")
    p.add_argument("--collectives", default="all", choices=("all", "steps", "none"),
                   help="programs compiled partitioned on CPU for collective counts and "
                        "activation bytes: all, steps (extend and decode steps under TP), none")
    p.add_argument("--server-flags", default="", help="flags of the server whose steps these are")
    p.add_argument("--output", default=None)
    p.add_argument("--plan", default=None, metavar="REPORT",
                   help="print the HBM plan of REPORT's last model for tpu and exit")
    args = p.parse_args(argv)
    if args.plan:
        report = json.loads(Path(args.plan).read_text())
        model = list(report["models"].values())[-1]
        rows = hbm_plan({k: v for k, v in model.items() if k.startswith("tpu")})
        print(plan_markdown(rows))
        print(f"\n--mem-fraction-static default: {default_mem_fraction(rows)}")
        return
    tps = [int(t) for t in args.tp_size.split(",")]
    devices = f"--xla_force_host_platform_device_count={max(tps)}"
    if devices not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts its CPU backend
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {devices}".strip()
    lowering = importlib.import_module(LOWERING)  # JAX starts with the flags above
    sources = [(args.model_path or "default", None)]
    sources += [(Path(c).parent.name if c.endswith(".json") else Path(c).name, c)
                for c in args.model_config]
    words = sys.argv[1:] if argv is None else argv
    report: dict[str, Any] = {"command": " ".join(["python -m sgl_tpu.bench.lowering", *words]),
                              "models": {}}
    flags = args.server_flags.split()
    for label, config_json in sources:
        cfg = model_config(None if config_json else args.model_path, config_json)
        setups = report["models"].setdefault(label, {})
        for platform in args.lower.split(","):
            for tp in (tps if platform == "tpu" else
                       [int(t) for t in args.cuda_tp_size.split(",")]):
                print(f"lowering {label} for {platform} at tp={tp}", file=sys.stderr, flush=True)
                setups[f"{platform} tp={tp}"] = lowering.lower_setup(cfg, platform, tp, flags,
                                                                     args.collectives)
                if args.output:
                    Path(args.output).write_text(json.dumps(report, indent=1))
    if not args.output:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
