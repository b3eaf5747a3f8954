"""serve.py's options: one typed object, parsed once from the command line and passed whole to
the supervisor, every worker and the HTTP app.

    cfg, options = load_config(argv, prog="serve.py", script=ServeOptions)
    options.check()                       # ConfigError listing every bad value
    options.effective_api_key()           # --api-key, else $GPT2S_API_KEY
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass

from config import Config, ConfigError, field_problems, opt
from engine.fields import NON_NEGATIVE, Range
from engine.inference.options import InferenceOptions

API_KEY_ENV = "GPT2S_API_KEY"  # the key from the environment, so it need not show in `ps`


@dataclass
class ServeOptions(InferenceOptions):
    """serve.py's options: the model's source (--init-from, --sparse: shared with generate.py),
    then the server's; the rest of the command line is the config (--checkpoint, --quantize,
    --compile, --device, --dtype, --prompt_bucket ...)."""

    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = opt(8000, "port to listen on; 0 = any free port (printed at start)",
                    check=Range(ge=0, le=65535))
    workers: int = opt(1, "processes behind the port, sharing one copy of the weights",
                       check=Range(ge=1))
    slots: int = opt(8, "decode slots per worker: sequences generated together in one batch",
                     check=Range(ge=1))
    max_queue: int = opt(32, "sequences per worker waiting for a slot; beyond: 503 + Retry-After",
                         check=NON_NEGATIVE)
    max_tokens_limit: int = opt(1024, "the largest max_tokens a request may ask for (else 400)",
                                check=Range(ge=1))
    max_prompt_tokens: int = opt(0, "the longest prompt in tokens (else 400); 0 = block_size",
                                 check=NON_NEGATIVE)
    model_name: str = opt("", "the model id in the API; '' = the run's folder or GPT-2 name")
    warmup: bool = opt(True, "run (with --compile: compile) every shape before reporting "
                       "healthy, so the first request is as fast as later ones")
    idle_release_s: float = opt(30.0, "hand cached CUDA memory back after this many idle "
                                "seconds (system.empty_cache)", check=NON_NEGATIVE)
    share_weights: bool = opt(True, "workers share the weights loaded once (false: each "
                              "worker loads its own copy, for comparison)")
    threads: int = opt(0, "torch threads per worker; 0 = system.threads (or the cores) / workers",
                       check=NON_NEGATIVE)
    retry_after_s: int = opt(1, "the Retry-After seconds of a 503 (queue full)",
                             check=NON_NEGATIVE)
    access_log: bool = opt(False, "uvicorn's access log, one line per request")
    api_key: str = opt("", "every /v1 request must send 'Authorization: Bearer KEY' (else 401; "
                       "/health and /metrics stay open); default: $GPT2S_API_KEY, '' = none")
    allow_no_key: bool = opt(False, "serve a --host other than loopback without an API key "
                             "(else refused at start)")
    max_body_bytes: int = opt(1 << 20, "the largest request body in bytes, else 413 before it is "
                              "read whole; 1 MiB holds a 1024-token prompt of GPT-2's longest "
                              "tokens as JSON (384 KiB); 0 = no limit", check=NON_NEGATIVE)

    def __repr__(self) -> str:
        """Every option but the API key's value, which no log or traceback should show."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name != "api_key"]
        return f"ServeOptions({', '.join(shown)}, api_key=...)"

    def check(self) -> None:
        """Every value outside its field's check=, in one ConfigError; a host reachable from
        other machines needs an API key (or --allow-no-key)."""
        problems = field_problems(self, lambda name: f"--{name.replace('_', '-')}")
        if problems:
            raise ConfigError("invalid options: " + "; ".join(problems))
        if not self.effective_api_key() and not self.allow_no_key and not is_loopback(self.host):
            raise ConfigError(f"--host {self.host} is reachable from other machines but no API "
                              f"key is set; pass --api-key KEY (or set {API_KEY_ENV}), or "
                              "--allow-no-key true to serve without one")

    def effective_api_key(self) -> str:
        """--api-key, else $GPT2S_API_KEY; '' = none."""
        return self.api_key or os.environ.get(API_KEY_ENV, "")

    def threads_per_worker(self, cfg: Config) -> int:
        """--threads, else system.threads (or the cores) split between the workers."""
        cores = cfg.system.threads or os.cpu_count() or 1
        return self.threads or max(1, cores // self.workers)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
