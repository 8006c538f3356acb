"""Benchmark targets: the `--compare` spec syntax, and starting/stopping the servers it names.

    NAME=KIND:VALUE[,KEY:VALUE...]

    KIND (exactly one)
      launch:FLAGS        start sgl-tpu (`python -m sgl_tpu.launch_server FLAGS`), stop it after;
                          FLAGS may be empty: `sgl-tpu=launch:`
      url:URL             a server that is already running
      llamacpp:PYTHON     start the llama.cpp peer with that interpreter (its own venv) on the
                          same GGUF, with the settings of shared/docs/peers.md
      llama-server:PATH   start llama.cpp's own server (that binary; shared/peers/
                          build_llama_server.sh builds it) on the same GGUF, with
                          LLAMA_SERVER_FLAGS plus `args:` (e.g. `args:-np 4 --cache-ram 2048`)
    KEY
      api:API             native | openai-completions | openai-chat
                          (default: native, or openai-completions for llamacpp)
      json:DIALECT        structured-output dialect, openai | llamacpp (default: llamacpp for
                          the llamacpp kind, else openai); see drivers.py
      args:ARGS           extra arguments for a llama.cpp peer, e.g. `args:--cache True`
      script:PATH         the peer's launcher (default: shared/peers/llamacpp_server.py, looked
                          for above this package)
      model:NAME          the OpenAI `model` field (default: omitted)

Fields are split at a comma that starts a known `KEY:`, so flags may contain commas. Examples:
    sgl-tpu=launch:
    sgl-tpu-nocache=launch:--disable-radix-cache
    llamacpp=llamacpp:../peer-venv/bin/python,args:--cache True
    remote=url:http://127.0.0.1:8091,api:openai-completions,json:llamacpp
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sgl_tpu.bench.agent_loop.drivers import DRIVERS, JSON_DIALECTS
from sgl_tpu.bench.http_load import READY_POLL_S, Server, free_port

KINDS = ("launch", "url", "llamacpp", "llama-server")
PEERS = ("llamacpp", "llama-server")
KEYS = (*KINDS, "api", "json", "args", "script", "model")
_FIELD_SPLIT = re.compile(r",(?=(?:" + "|".join(KEYS) + r"):)")
PEER_SCRIPT = Path("shared") / "peers" / "llamacpp_server.py"
PEER_FLAGS = ("--n_ctx", "8192", "--n_threads", "1", "--n_threads_batch", "2",
              "--interrupt_requests", "False", "--logits_all", "False")
# llama-server: 2 threads for decode and prefill (this host's cores), tool-call templates;
# slots (-np), context (-c, shared by the slots) and --cache-ram come with `args:`
LLAMA_SERVER_FLAGS = ("-t", "2", "-tb", "2", "--jinja")
READY_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class TargetSpec:
    name: str
    kind: str
    value: str
    api: str
    json_dialect: str
    args: str = ""
    script: str | None = None
    model: str | None = None


def parse_target(spec: str) -> TargetSpec:
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"target {spec!r}: expected NAME=KIND:VALUE[,KEY:VALUE...]")
    fields: dict[str, str] = {}
    for part in _FIELD_SPLIT.split(rest):
        key, colon, value = part.partition(":")
        key = key.strip()
        if not colon or key not in KEYS:
            raise ValueError(f"target {name!r}: unknown field {part!r}; keys: {', '.join(KEYS)}")
        if key in fields:
            raise ValueError(f"target {name!r}: {key} given twice")
        fields[key] = value.strip()
    kinds = [k for k in KINDS if k in fields]
    if len(kinds) != 1:
        raise ValueError(f"target {name!r}: give exactly one of {', '.join(KINDS)}")
    kind = kinds[0]
    api = fields.get("api") or ("openai-completions" if kind in PEERS else "native")
    if api not in DRIVERS:
        raise ValueError(f"target {name!r}: api must be one of {', '.join(DRIVERS)}")
    dialect = fields.get("json") or ("llamacpp" if kind in PEERS else "openai")
    if dialect not in JSON_DIALECTS:
        raise ValueError(f"target {name!r}: json must be one of {', '.join(JSON_DIALECTS)}")
    if kind in ("url", *PEERS) and not fields[kind]:
        raise ValueError(f"target {name!r}: {kind} needs a value")
    return TargetSpec(name.strip(), kind, fields[kind], api, dialect, fields.get("args", ""),
                      fields.get("script"), fields.get("model"))


def find_peer_script() -> Path:
    for parent in Path(__file__).resolve().parents:
        candidate = parent / PEER_SCRIPT
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{PEER_SCRIPT} not found above {Path(__file__).parent}; "
                            "give the launcher with script:PATH")


def _wait_http_ok(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(READY_POLL_S)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")


class RunningTarget:
    """Context manager: starts the target's server if it launches one; yields its base URL."""

    def __init__(self, spec: TargetSpec, model_path: str | None, log_dir: Path,
                 chat_template: str | None = None) -> None:
        self.spec = spec
        self.model_path = model_path
        self.chat_template = chat_template
        self.log_path = log_dir / f"agent_loop_{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}.log"
        self.base_url = spec.value.rstrip("/") if spec.kind == "url" else ""
        self._server: Server | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> RunningTarget:
        if self.spec.kind == "launch":
            flags = shlex.split(self.spec.value)
            if self.model_path and "--model-path" not in flags:
                flags += ["--model-path", self.model_path]
            if self.chat_template and "--chat-template" not in flags:
                flags += ["--chat-template", self.chat_template]
            self._server = Server(flags, str(self.log_path))
            self.base_url = self._server.url
            try:
                self._server.wait_ready(READY_TIMEOUT_S)
            except BaseException:
                self._server.stop()
                raise
        elif self.spec.kind in PEERS:
            self._start_peer()
        return self

    def _start_peer(self) -> None:
        from sgl_tpu.loader import resolve_model_path

        gguf = str(resolve_model_path(self.model_path))  # a packaged model's name: its file
        port = free_port()
        if self.spec.kind == "llama-server":
            cmd = [self.spec.value, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                   *LLAMA_SERVER_FLAGS, *shlex.split(self.spec.args)]
        else:
            script = Path(self.spec.script) if self.spec.script else find_peer_script()
            cmd = [self.spec.value, str(script), "--model", gguf, "--host", "127.0.0.1",
                   "--port", str(port), *PEER_FLAGS, *shlex.split(self.spec.args)]
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_http_ok(self.base_url + "/v1/models", self._proc, READY_TIMEOUT_S)
        except BaseException:
            self._stop_peer()
            raise

    def _stop_peer(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()

    def flush_cache(self) -> bool:
        """Empty the server's prefix cache between workloads (sgl-tpu/SGLang only)."""
        if self.spec.kind in PEERS:
            return False
        req = urllib.request.Request(self.base_url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def server_info(self) -> dict | None:
        """sgl-tpu's `/server_info` (pool size, tiers), or None for the peers."""
        if self.spec.kind in PEERS:
            return None
        try:
            with urllib.request.urlopen(self.base_url + "/server_info", timeout=30) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def replica_requests(self) -> list[int] | None:
        """Behind SGLang's router (a `--dp-size` server): each replica's finished-request count
        (its `/server_info`), in the router's `/workers` order; None for any other server."""
        if self.spec.kind in PEERS:
            return None
        try:
            workers = _get_json(self.base_url + "/workers").get("workers")
            if not isinstance(workers, list) or not workers:
                return None
            return [_get_json(w["url"] + "/server_info")["stats"]["num_requests_finished"]
                    for w in workers]
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError,
                AttributeError):
            return None

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop()
        self._stop_peer()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())
