"""serve.py's processes: a supervisor that loads the weights once, binds the port and forks
`workers` processes that share the weights' pages (copy-on-write, never written: one copy in
memory), restarts a worker that dies, and on SIGTERM lets the workers finish what they run.

    Supervisor(cfg, options, load_for_serving(cfg, options, device)).run()   # -> exit code

Each worker runs uvicorn on the inherited socket with its own BatchEngine (its slots, its queue,
its share of the cores). The supervisor never runs a multi-threaded torch op before forking (a
forked child of a process whose OpenMP pool has started hangs at its first parallel op), nor
starts CUDA (device_before_fork; the child of a process that started CUDA cannot use it): each
worker moves the weights, loaded on the CPU, to its GPU itself.

Metrics: the supervisor points PROMETHEUS_MULTIPROC_DIR at a fresh folder before forking (and
removes it at exit), so every worker writes its counters there and /metrics, from any worker,
adds them up; a dead worker's gauges are dropped (its counters stay in the sums).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from config import Config, ConfigError
from data import chat_template
from data.tokenizer import from_meta
from engine.device import Runtime, resolve_device, setup
from engine.inference.load import load_for_inference, prepare_weights
from engine.inference.sampling import call_forward_directly
from engine.serving.options import ServeOptions

if TYPE_CHECKING:  # imported by the worker only, after the fork
    from engine.serving.batching import BatchEngine

RESTARTS_PER_MINUTE = 5  # more crashes than this in a minute: stop, something is wrong
STOP_GRACE_S = 600.0  # after SIGTERM, running requests get this long before workers are killed
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode: its folder
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # 1: torch.cuda.is_available asks NVML


def log(text: str) -> None:
    print(f"serve: {text}", file=sys.stderr, flush=True)


@dataclass
class LoadedModel:
    """A model ready to serve (on the CPU until a worker moves it), and what describes it."""

    model: Any
    tokenizer: Any
    name: str
    label: str
    template: chat_template.ChatTemplate | None = None  # for /v1/chat/completions


def device_before_fork(name: str) -> torch.device:
    """resolve_device(name) (a device this machine lacks fails here, before any fork) without
    starting CUDA in this process: the CUDA runtime's device count, behind a plain
    torch.cuda.is_available(), starts it, after which no forked child can use CUDA. Under
    PYTORCH_NVML_BASED_CUDA_CHECK=1 torch counts the GPUs through NVML instead (should NVML fail,
    torch falls back to the runtime's count, and the workers fail at their first CUDA call)."""
    saved = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        return resolve_device(name)
    finally:
        if saved is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = saved


def load_for_serving(cfg: Config, options: ServeOptions,
                     device: torch.device = torch.device("cpu")) -> LoadedModel:
    """The model generate.py would sample from (options.model_source; int8 layers if
    sample.quantize), on the CPU, with its tokenizer and chat template (meta.json's "template"
    of an instruction-finetuned checkpoint; None: none). Served on the CPU (`device`), its weights
    are prepared here (prepare_for_serving), before any fork, so the workers share them; a GPU
    worker prepares them after moving them."""
    model, meta, label = load_for_inference(cfg, options, "cpu", "serve")
    if device.type == "cpu":
        prepare_for_serving(model, cfg, options, device)
    step = f" (step {meta['step']})" if "step" in meta else ""
    name = options.model_name or served_name(options.model_source(cfg))
    tokenizer = from_meta(meta["tokenizer"])
    template = None
    if "template" in meta:
        template = chat_template.from_meta(meta["template"])
        template.end_id(tokenizer)  # a template needs an end-of-turn token: fail at load
    return LoadedModel(model.eval(), tokenizer, name, label + step, template)


def prepare_for_serving(model, cfg: Config, options: ServeOptions, device: torch.device) -> None:
    """generate.py's preparation of the weights (prepare_weights), a pruned model's
    sparse kernels probed at --slots rows (a decode step's), said in the log."""
    prepared = prepare_weights(model, cfg, options, device, options.slots)
    call_forward_directly(model)  # the blocks' parts called without nn.Module's hook checks
    log(f"weights={prepared.weights}")
    if prepared.sparse:
        log(prepared.sparse)


def served_name(source: str) -> str:
    """The id /v1/models shows: a run's folder name (not its ckpt_N), or the GPT-2 name."""
    path = Path(source.removeprefix("hf:"))
    if path.name.startswith("ckpt_") and path.parent.name:
        return path.parent.name
    return path.name or source


def die_with_parent() -> None:
    """A worker ends if the supervisor is killed outright (Linux), never serving alone."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exit_now(sig: int, frame) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(cfg: Config, options: ServeOptions, loaded: LoadedModel | None, sock: socket.socket,
               ready_fd: int) -> int:
    """A worker process, after the fork: its engine and uvicorn on the shared socket."""
    import uvicorn

    from engine.serving.app import ServedModel, create_app

    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before uvicorn: end now; uvicorn takes them
        signal.signal(sig, exit_now)  # over, and raises them again once it has drained
    torch.set_num_threads(options.threads_per_worker(cfg))
    rt = setup(cfg.system)
    loaded = loaded or load_for_serving(cfg, options, rt.device)
    engine = start_engine(cfg, options, loaded, rt)
    served = ServedModel(loaded.name, engine.block_size, engine.raw_model.config.vocab_size,
                         options, loaded.template)
    app = create_app(engine, served, loaded.tokenizer, on_ready=lambda: os.write(
        ready_fd, f"{engine.warmup_seconds:.2f}\n".encode()))
    config = uvicorn.Config(app, log_level="warning", access_log=options.access_log,
                            lifespan="on", timeout_graceful_shutdown=None)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def start_engine(cfg: Config, options: ServeOptions, loaded: LoadedModel,
                 rt: Runtime) -> BatchEngine:
    """The worker's model on its device (prepared there, unless the supervisor did it on the
    CPU), compiled if system.compile, in a BatchEngine with the worker's slots and queue."""
    from engine.serving.batching import BatchEngine

    raw_model = loaded.model.to(rt.device)
    if rt.device.type != "cpu":  # on the CPU the supervisor did it, before the fork
        prepare_for_serving(raw_model, cfg, options, rt.device)
    model = raw_model
    if cfg.system.compile:
        from engine.compiling import compile_model

        model, _ = compile_model(raw_model, cfg.system, rt)
    return BatchEngine(model, raw_model, loaded.tokenizer, rt.device, options.slots,
                       options.max_queue,
                       prompt_bucket=cfg.sample.prompt_bucket if cfg.system.compile else 0,
                       prefill_chunk=cfg.sample.prefill_chunk, autocast=rt.autocast,
                       static=cfg.system.compile, warmup=options.warmup,
                       idle_release_s=options.idle_release_s,
                       empty_cache=cfg.system.empty_cache, log=log)


@dataclass
class Worker:
    index: int
    pid: int
    ready_fd: int
    started: float
    ready: bool = False


class Supervisor:
    """Binds the port, forks the workers, restarts the ones that die, stops on SIGTERM/SIGINT."""

    def __init__(self, cfg: Config, options: ServeOptions, loaded: LoadedModel | None):
        """loaded: the weights the workers share (None: each worker loads its own). LoadedModel
        with torch at one thread (see the module docstring)."""
        self.cfg, self.options, self.loaded = cfg, options, loaded
        self.workers: dict[int, Worker] = {}
        self.crashes: list[float] = []
        self.stop_at: float | None = None
        self.signalled = False
        self.sock: socket.socket | None = None

    def run(self) -> int:
        o = self.options
        try:
            self.sock = socket.create_server((o.host, o.port), backlog=2048)
        except OSError as e:
            raise ConfigError(f"cannot listen on {o.host}:{o.port} ({e.strerror}); pass "
                              "another --port (0: any free one) or --host") from None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        host, port = self.sock.getsockname()[:2]
        log(f"listening on http://{host}:{port} (workers {o.workers} x "
            f"{o.threads_per_worker(self.cfg)} threads, {o.slots} slots and a {o.max_queue} "
            f"queue each, weights {'shared' if o.share_weights else 'one copy per worker'}; "
            f"/v1 {'needs the API key' if o.effective_api_key() else 'is open: no API key'})")
        with metrics_folder() as folder:
            log(f"metrics of every worker in {folder}")
            for index in range(o.workers):
                self._spawn(index)
            return self._watch()

    def _on_signal(self, sig: int, frame) -> None:
        self.signalled = True

    def _spawn(self, index: int) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.close(read_fd)
                code = run_worker(self.cfg, self.options, self.loaded, self.sock, write_fd)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write_fd)
        self.workers[pid] = Worker(index, pid, read_fd, time.monotonic())

    def _watch(self) -> int:
        """The supervisor's loop: readiness, deaths, restarts, the stop. -> exit code."""
        code = 0
        while self.workers:
            if self.signalled and self.stop_at is None:
                self._begin_stop()
            if self.stop_at is not None and time.monotonic() > self.stop_at:
                for pid in self.workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._read_ready()
            code = self._reap() or code
        log("stopped")
        return code

    def _read_ready(self) -> None:
        fds = {w.ready_fd: w for w in self.workers.values()}
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select(list(fds), [], [], 0.2)
            for fd in readable:
                data = os.read(fd, 64).decode().strip()
                w = fds[fd]
                if data and not w.ready:
                    w.ready = True
                    log(f"worker {w.index} (pid {w.pid}) ready, warm-up {data}s")

    def _reap(self) -> int:
        """Collect dead workers; restart the ones that died while serving. -> exit code."""
        code = 0
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return code
            if pid == 0 or pid not in self.workers:
                return code
            w = self.workers.pop(pid)
            os.close(w.ready_fd)
            from prometheus_client import multiprocess  # only now: see metrics_folder
            multiprocess.mark_process_dead(pid)  # its gauges leave the sums
            if self.stop_at is not None:
                continue
            how = (f"signal {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
                   if os.WIFSIGNALED(status) else f"exit code {os.waitstatus_to_exitcode(status)}")
            now = time.monotonic()
            self.crashes = [t for t in self.crashes if now - t < 60] + [now]
            if not w.ready:
                log(f"worker {w.index} (pid {pid}) failed during start-up ({how}); stopping")
                code = 1
                self._begin_stop()
            elif len(self.crashes) > RESTARTS_PER_MINUTE:
                log(f"worker {w.index} died ({how}), {len(self.crashes)} deaths in a minute; "
                    "stopping")
                code = 1
                self._begin_stop()
            else:
                log(f"worker {w.index} (pid {pid}) died ({how}); its requests failed; restarting")
                self._spawn(w.index)
        return code

    def _begin_stop(self) -> None:
        """Stop taking requests; the workers finish the running ones, then exit."""
        log("stopping: finishing running requests")
        self.stop_at = time.monotonic() + STOP_GRACE_S
        if self.sock is not None:
            self.sock.close()
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def metrics_folder():
    """A fresh folder for prometheus_client's multiprocess mode, in the environment that the
    workers inherit; removed, and the environment restored, at the end. prometheus_client picks
    its mode when first imported, so nothing here imports it before this."""
    before = os.environ.get(MULTIPROC_ENV)
    folder = tempfile.mkdtemp(prefix="gpt2s-metrics-")
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if before is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = before


def pss_bytes(pid: int) -> int:
    """The process's proportional set size: each shared page split between its sharers."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/smaps_rollup has no Pss line")
