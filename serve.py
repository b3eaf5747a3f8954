"""Serve a trained model or GPT-2 over an OpenAI-compatible HTTP API, with continuous batching.

    python serve.py --checkpoint out/shakespeare_char            # http://127.0.0.1:8000
    python serve.py --init-from gpt2 --slots 16 --workers 2 --port 8080
    python serve.py --compile true --quantize int8                # warmed (compiled) before healthy
    GPT2S_API_KEY=secret python serve.py --host 0.0.0.0            # /v1 needs the key
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "ROMEO:", "max_tokens": 64, "temperature": 0}'

Endpoints: POST /v1/completions (stream: server-sent events), POST /v1/chat/completions (a
model with a chat template: docs/serve.md#chat), GET /v1/models, GET /health,
GET /metrics (Prometheus), GET / (a playground page in the browser). How it works, and what it
measured: docs/serve.md.
"""
import gc
import importlib.util
import sys

from config import Config, ConfigError, help_first, load_config
from engine.serving.options import ServeOptions

# --help needs nothing more: it is answered here, before the imports of a run (torch, the model)
help_first("serve.py", ServeOptions, lead=("sample", "system"), main=__name__)

import torch  # noqa: E402 (this and what follows: after --help)

from data.chat_template import TemplateError
from data.tokenizer import TokenizerError
from engine import checkpoint
from engine.device import SetupError
from engine.inference.matvec import huge_pages_for, weight_layout_for
from engine.serving.supervisor import Supervisor, device_before_fork, load_for_serving, log


def check_server_packages() -> None:
    """Before any model is loaded: the HTTP side's libraries (pyproject.toml's serve group)."""
    missing = [name for name in ("fastapi", "pydantic", "uvicorn", "httpx", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"serve.py needs {', '.join(missing)}: pip install {' '.join(missing)}"
                          " (or pip install -e \".[serve]\")")


def serve(cfg: Config, o: ServeOptions) -> int:
    """Load the model once, then the supervisor's loop until SIGTERM/SIGINT. -> exit code."""
    device = device_before_fork(cfg.system.device)  # checked without starting CUDA here
    torch.set_num_threads(1)  # no OpenMP pool before the forks (engine/serving/supervisor.py)
    loaded = load_for_serving(cfg, o, device)  # errors before any fork
    s = cfg.sample
    log(f"serving {loaded.name!r} from {loaded.label} | device {device} | dtype "
        f"{cfg.system.dtype} | compile {'on' if cfg.system.compile else 'off'}"
        + (f" (prompt bucket {s.prompt_bucket})" if cfg.system.compile else "")
        + f" | quantize {s.quantize} | weight_layout={weight_layout_for(s.weight_layout, device)}"
        f" ({s.weight_layout}) huge_pages={huge_pages_for(s.huge_pages, device)[1]}")
    if loaded.template is not None:
        log(f"chat: POST /v1/chat/completions through the {loaded.template.name!r} template")
    if not o.share_weights:  # each worker loads its own copy
        loaded = None
        gc.collect()
    return Supervisor(cfg, o, loaded).run()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="serve.py",
                                   script=ServeOptions, lead=("sample", "system"))
        options.check()
        check_server_packages()
        return serve(cfg, options)
    except (ConfigError, checkpoint.CheckpointError, TokenizerError, TemplateError,
            SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
