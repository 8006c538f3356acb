"""A random-weight Hugging Face checkpoint of a model's shape, for timing a machine that lacks
the model's weights (the library: sgl_tpu/bench/random_checkpoint.py).

    python tools/random_checkpoint.py shape DIR [--model-path M] [--minimal]
    python tools/random_checkpoint.py weights DIR [--seed 0] [--std 0.02]
"""

from __future__ import annotations

import argparse

from sgl_tpu.bench.random_checkpoint import write_shape, write_weights


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    shape = sub.add_parser("shape", help="config + tokenizer files of a model, no weights")
    shape.add_argument("out_dir")
    shape.add_argument("--model-path", default=None)
    shape.add_argument("--minimal", action="store_true",
                       help="one layer of width 64 (same vocabulary and tokenizer)")
    weights = sub.add_parser("weights", help="random weights for DIR/config.json")
    weights.add_argument("model_dir")
    weights.add_argument("--seed", type=int, default=0)
    weights.add_argument("--std", type=float, default=0.02)
    args = p.parse_args(argv)
    if args.command == "shape":
        print(write_shape(args.out_dir, args.model_path, args.minimal))
    else:
        print(write_weights(args.model_dir, args.seed, args.std))


if __name__ == "__main__":
    main()
