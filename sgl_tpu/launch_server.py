"""`python -m sgl_tpu.launch_server [flags]`: serve a model over HTTP (default: SmolLM2-135M on
127.0.0.1:30000); with `--dp-size N`, N replicas behind the sglang-router. See
`python -m sgl_tpu.launch_server --help`."""

from __future__ import annotations

import os


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.expanduser("~/.cache/sgl_tpu/jax_cache"))
    from sgl_tpu.cli import parse_args

    args = parse_args(argv)
    if args.nnodes > 1 and args.node_rank > 0:  # a follower host: no HTTP, no scheduler
        from sgl_tpu.parallel.runner_factory import run_follower_host

        raise SystemExit(run_follower_host(args))
    if args.dp_size > 1:  # replicas behind the sglang-router
        from sgl_tpu.server.replicas import launch_replicas

        launch_replicas(args)
        return
    from sgl_tpu.server.launch import launch_server

    launch_server(args)


if __name__ == "__main__":
    main()
