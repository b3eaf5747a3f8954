"""llama.cpp as an outside row of `python bench.py decode`, run by the Python that has
llama-cpp-python (its own virtual environment; this file imports nothing of ours).

    python scripts/llama_decode.py MODEL.gguf --threads 2 --prompt 1,2,3
    # then one line per run on stdin: N -> one JSON line {"tokens": [...]} after N greedy tokens

The model stays loaded between runs, so the benchmark can take turns with the other engines;
each run clears the context and reads the prompt again, as our runs do.
"""
from __future__ import annotations

import argparse
import json
import sys


def load(path: str, threads: int, extra_buffers: bool):
    import llama_cpp
    if not extra_buffers:  # ggml's AMX buffers stopped with SIGILL (tilezero) on a KVM guest
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_model_default_params = params
        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    return llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                           verbose=False, seed=0), llama_cpp.__version__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", required=True, help="token ids, comma separated")
    parser.add_argument("--extra-buffers", action="store_true",
                        help="let ggml use its extra (AMX) weight buffers")
    args = parser.parse_args()
    prompt = [int(t) for t in args.prompt.split(",")]
    llm, version = load(args.model, args.threads, args.extra_buffers)
    print(json.dumps({"ready": version}), flush=True)
    for line in sys.stdin:
        n, tokens = int(line), []
        llm.reset()
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == n:
                break
        print(json.dumps({"tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
