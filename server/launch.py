"""Launcher: start the scheduler and detokenizer processes, wait until both are ready (model
loaded, buckets compiled), then serve HTTP. A watchdog marks the server unhealthy, fails
in-flight requests and shuts down if a child dies; SIGINT/SIGTERM stop everything cleanly.
Children watch their parent's pid and exit when it is gone, so nothing is orphaned.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import sys

import uvicorn

from sgl_tpu.choices import check_registry_names
from sgl_tpu.config import ServerArgs
from sgl_tpu.mem_cache.disk_folder import StorageDirError, open_storage_dir, storage_dir
from sgl_tpu.parallel.head_split import check_tp_size
from sgl_tpu.server.detokenizer_process import run_detokenizer_process
from sgl_tpu.server.ipc import PortArgs
from sgl_tpu.server.ready import READY_MESSAGE
from sgl_tpu.server.scheduler_process import run_scheduler_process

logger = logging.getLogger("sgl_tpu.launch")
WATCHDOG_PERIOD_S = 1.0


def launch_server(args: ServerArgs) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s %(name)s] %(message)s")
    check_registry_names(args)  # a bad name fails here, before any process starts
    _check_storage_dir(args)
    ports = PortArgs.for_pid()
    ctx = mp.get_context("spawn")
    parent = os.getpid()
    procs = {
        "scheduler": ctx.Process(target=run_scheduler_process, args=(args, ports, parent),
                                 name="sgl_tpu-scheduler", daemon=True),
        "detokenizer": ctx.Process(target=run_detokenizer_process,
                                   args=(args, ports, parent), name="sgl_tpu-detokenizer",
                                   daemon=True),
    }
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(_serve(args, ports, procs))
    finally:
        started = [p for p in procs.values() if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for path in ports.paths():
            if os.path.exists(path):
                os.unlink(path)


def _check_storage_dir(args: ServerArgs) -> None:
    """An unsafe disk tier folder (another user's, writable by others) ends the start with one
    clear line; one that cannot be made is left to the scheduler (host tier only)."""
    if not args.enable_hierarchical_cache or args.hicache_storage_backend != "file":
        return
    try:
        open_storage_dir(storage_dir(args.hicache_storage_dir),
                         is_default=args.hicache_storage_dir is None)
    except StorageDirError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except OSError:
        pass


def event_loop_factory():
    """uvloop's event loop where it is installed (a dependency except on Windows): this
    process's loop runs every HTTP connection and every streamed chunk, and libuv's costs a
    fraction of asyncio's per callback; else None (asyncio's)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# An idle keep-alive connection stays open this long. Agents idle between turns while a tool
# runs, and their HTTP clients pool connections for longer than uvicorn's 5 s default (aiohttp
# 15 s): a request sent as the server closes the connection is lost to the client. Past every
# common client's pool expiry, the client closes first.
KEEP_ALIVE_S = 75


async def _serve(args: ServerArgs, ports: PortArgs, procs: dict[str, mp.Process]) -> None:
    from sgl_tpu.loader import load_model
    from sgl_tpu.loader.chat_templates import with_chat_template
    from sgl_tpu.server.http_server import create_app
    from sgl_tpu.server.tokenizer_manager import TokenizerManager

    try:
        loaded = load_model(args.model_path)  # tokenizer + config (GGUF weights are mmapped)
    except (ValueError, OSError, KeyError, NotImplementedError) as e:
        # A model that cannot be served: one clear line, no traceback, a non-zero exit.
        print(f"error: cannot load --model-path {args.model_path!r}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None
    try:  # a --tp-size the heads do not allow: refused before any process starts
        check_tp_size(loaded.config, args.tp_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    tokenizer = with_chat_template(loaded.tokenizer, args.chat_template)
    tm = TokenizerManager(args, ports, tokenizer, loaded.config.vocab_size, loaded.model_path)
    del loaded
    tm.start()
    for p in procs.values():
        p.start()
    server: uvicorn.Server | None = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def watchdog() -> None:
        while True:
            for name, p in procs.items():
                if not p.is_alive():
                    tm.mark_dead(f"{name} process died (exit code {p.exitcode})")
                    stop.set()
                    return
            await asyncio.sleep(WATCHDOG_PERIOD_S)

    watch = asyncio.ensure_future(watchdog())
    ready = asyncio.ensure_future(tm.wait_ready())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set() or ready.exception() is not None:
        reason = tm.dead_reason or "stopped before ready"
        logger.error("server did not start: %s", reason)
        ready.cancel()
        watch.cancel()
        tm.close()
        raise SystemExit(1)
    app = create_app(tm)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # ours above
    serve = asyncio.ensure_future(server.serve())
    logger.info("server ready on http://%s:%d", args.host, args.port)
    print(f"{READY_MESSAGE} http://{args.host}:{args.port}", flush=True)
    await asyncio.wait({serve, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if tm.dead_reason:
        await asyncio.sleep(0.5)  # let failing requests get their error responses out
    server.should_exit = True
    await serve
    watch.cancel()
    tm.close()
    if tm.dead_reason:
        raise SystemExit(1)
