"""Serve a trained model or GPT-2 over an OpenAI-compatible HTTP API, with continuous batching.

    python serve.py --checkpoint out/shakespeare_char            # http://127.0.0.1:8000
    python serve.py --init-from gpt2 --slots 16 --workers 2 --port 8080
    python serve.py --compile true --quantize int8                # warmed (compiled) before healthy
    GPT2S_API_KEY=secret python serve.py --host 0.0.0.0            # /v1 needs the key
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "ROMEO:", "max_tokens": 64, "temperature": 0}'

Endpoints: POST /v1/completions (stream: server-sent events), GET /v1/models, GET /health,
GET /metrics (Prometheus), GET / (a playground page in the browser). How it works, and what it
measured: docs/serve.md.
"""
import gc
import importlib.util
import ipaddress
import os
import sys
from dataclasses import dataclass

import torch

from config import ConfigError, load_config, opt
from engine import checkpoint, runtime, sparse
from engine.sampling import huge_pages_for, weight_layout_for
from engine.serving.workers import Supervisor, WorkerSpec, load_for_serving, log
from data.tokenizer import TokenizerError

API_KEY_ENV = "GPT2S_API_KEY"  # the key from the environment, so it need not show in `ps`


@dataclass
class ServeOptions:
    """serve.py's own options (the rest of the command line is the config: --checkpoint,
    --quantize, --compile, --device, --dtype, --prompt_bucket ...)."""

    init_from: str = opt("", "serve gpt2[-medium|-large|-xl] | hf:ORG/NAME | a local HF dir | "
                         "our checkpoint; default: sample.checkpoint, else train.out_dir")
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = opt(8000, "port to listen on; 0 = any free port (printed at start)")
    workers: int = opt(1, "processes behind the port, sharing one copy of the weights")
    slots: int = opt(8, "decode slots per worker: sequences generated together in one batch")
    max_queue: int = opt(32, "sequences per worker waiting for a slot; beyond: 503 + Retry-After")
    max_tokens_limit: int = opt(1024, "the largest max_tokens a request may ask for (else 400)")
    max_prompt_tokens: int = opt(0, "the longest prompt in tokens (else 400); 0 = block_size")
    model_name: str = opt("", "the model id in the API; '' = the run's folder or GPT-2 name")
    warmup: bool = opt(True, "run (with --compile: compile) every shape before reporting "
                       "healthy, so the first request is as fast as later ones")
    idle_release_s: float = opt(30.0, "hand cached CUDA memory back after this many idle "
                                "seconds (system.empty_cache)")
    share_weights: bool = opt(True, "workers share the weights loaded once (false: each "
                              "worker loads its own copy, for comparison)")
    threads: int = opt(0, "torch threads per worker; 0 = system.threads (or the cores) / workers")
    retry_after_s: int = opt(1, "the Retry-After seconds of a 503 (queue full)")
    access_log: bool = opt(False, "uvicorn's access log, one line per request")
    sparse: str = opt("auto", "a pruned checkpoint (prune.py): auto = sparse kernels for the "
                      "weight shapes a timing probe at --slots rows finds faster here | sparse | "
                      "dense (its weights with zeros)", sparse.MODES)
    api_key: str = opt("", "every /v1 request must send 'Authorization: Bearer KEY' (else 401; "
                       "/health and /metrics stay open); default: $GPT2S_API_KEY, '' = none")
    allow_no_key: bool = opt(False, "serve a --host other than loopback without an API key "
                             "(else refused at start)")
    max_body_bytes: int = opt(1 << 20, "the largest request body in bytes, else 413 before it is "
                              "read whole; 1 MiB holds a 1024-token prompt of GPT-2's longest "
                              "tokens as JSON (384 KiB); 0 = no limit")


def check_options(o: ServeOptions) -> None:
    problems = [f"--{name.replace('_', '-')} must be {rule}, got {getattr(o, name)}"
                for name, rule, ok in (
                    ("port", "in 0..65535", 0 <= o.port <= 65535),
                    ("workers", ">= 1", o.workers >= 1), ("slots", ">= 1", o.slots >= 1),
                    ("max_queue", ">= 0", o.max_queue >= 0),
                    ("max_tokens_limit", ">= 1", o.max_tokens_limit >= 1),
                    ("max_prompt_tokens", ">= 0", o.max_prompt_tokens >= 0),
                    ("idle_release_s", ">= 0", o.idle_release_s >= 0),
                    ("threads", ">= 0", o.threads >= 0),
                    ("retry_after_s", ">= 0", o.retry_after_s >= 0),
                    ("max_body_bytes", ">= 0", o.max_body_bytes >= 0))
                if not ok]
    if problems:
        raise ConfigError("invalid options: " + "; ".join(problems))
    if not api_key(o) and not o.allow_no_key and not is_loopback(o.host):
        raise ConfigError(f"--host {o.host} is reachable from other machines but no API key is "
                          f"set; pass --api-key KEY (or set {API_KEY_ENV}), or --allow-no-key "
                          "true to serve without one")


def api_key(o: ServeOptions) -> str:
    """--api-key, else $GPT2S_API_KEY; '' = none."""
    return o.api_key or os.environ.get(API_KEY_ENV, "")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_server_packages() -> None:
    """Before any model is loaded: the HTTP side's libraries (pyproject.toml's serve group)."""
    missing = [name for name in ("fastapi", "pydantic", "uvicorn", "httpx", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"serve.py needs {', '.join(missing)}: pip install {' '.join(missing)}"
                          " (or pip install -e \".[serve]\")")


def serve(cfg, o: ServeOptions) -> int:
    """Load the model once, then the supervisor's loop until SIGTERM/SIGINT. -> exit code."""
    spec = WorkerSpec(cfg=cfg, host=o.host, port=o.port, workers=o.workers, slots=o.slots,
                      max_queue=o.max_queue, max_tokens=o.max_tokens_limit,
                      max_prompt_tokens=o.max_prompt_tokens, warmup=o.warmup,
                      idle_release_s=o.idle_release_s, share_weights=o.share_weights,
                      retry_after_s=o.retry_after_s, access_log=o.access_log, threads=o.threads,
                      init_from=o.init_from, model_name=o.model_name, sparse=o.sparse,
                      api_key=api_key(o), max_body_bytes=o.max_body_bytes)
    device = runtime.resolve_device(cfg.system.device)  # a device this machine lacks fails here
    torch.set_num_threads(1)  # no OpenMP pool before the forks (engine/serving/workers.py)
    loaded = load_for_serving(cfg, o.init_from, o.model_name, device, o.sparse,
                              o.slots)  # errors before any fork
    s = cfg.sample
    log(f"serving {loaded.name!r} from {loaded.label} | device {device} | dtype "
        f"{cfg.system.dtype} | compile {'on' if cfg.system.compile else 'off'}"
        + (f" (prompt bucket {s.prompt_bucket})" if cfg.system.compile else "")
        + f" | quantize {s.quantize} | weight_layout={weight_layout_for(s.weight_layout, device)}"
        f" ({s.weight_layout}) huge_pages={huge_pages_for(s.huge_pages, device)[1]}")
    if not o.share_weights:  # each worker loads its own copy
        loaded = None
        gc.collect()
    return Supervisor(spec, loaded).run()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="serve.py",
                                   script=ServeOptions, lead=("sample", "system"))
        check_options(options)
        check_server_packages()
        return serve(cfg, options)
    except (ConfigError, checkpoint.CheckpointError, TokenizerError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
