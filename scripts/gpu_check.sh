#!/usr/bin/env bash
# What only a GPU can check, in one pass sized for one H200 in about 6 minutes. Results go to
# bench_results/ (and to $OUT/bench_results/ when $OUT is set), named after the GPU.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --cpu           # every part at tiny size on the CPU (CI, dry run)
#   bash scripts/gpu_check.sh --results DIR   # write somewhere else than bench_results/
#
# Parts, in this order, each under its own time limit inside one overall budget:
#   env      nvidia-smi, python / torch / CUDA, which optional packages are missing
#   tests    python -m pytest -m cuda tests/: the CUDA variants of the flag tests (needs pytest)
#   compile  torch.compile of GPT-2 124M at context 1024 (configs/gpt2_124m.toml), two steps of
#            train.py: a compile failure shows here, early, with the warm-up's seconds and each
#            step's time in its note (the speedrun part then finds the same graphs cached)
#   decode   batch-1 decode tok/s on GPT-2 124M-shaped weights     (bench.py memory --part decode)
#            and pruned Linears: 2:4 semi-structured / CSR vs dense   (python -m engine.inference.sparse)
#   memory   the memory estimate beside the measured CUDA peaks    (bench.py memory --part train)
#   bench    the bench.py chain on GPT-2 124M at context 1024: tok/s and MFU per flag
#   speedrun configs/gpt2_124m_speedrun.toml beside configs/gpt2_124m.toml, a short run each on
#            tiny Shakespeare in GPT-2 tokens: step time and val (docs/speedrun.md)
#   summary  gpu_check_<gpu>.md / .json: all of the above on one page, and gpu_check_<gpu>.log
# A part whose package or device is missing is skipped with a line saying so. Without CUDA the
# script makes the CPU pass (as --cpu). Exit status 1 when a part failed or ran out of time.
#
# Environment: PYTHON (default python3), GPU_CHECK_CPU=1 (same as --cpu), GPU_CHECK_BUDGET
# (seconds, default 460), GPU_CHECK_PARTS (default tests,compile,decode,memory,bench,speedrun; env and
# summary always run), GPU_CHECK_TESTS (pytest targets), GPU_CHECK_WHEELS (a folder of wheels: pytest and
# its dependencies, installed offline into a temporary folder when pytest is missing),
# GPU_CHECK_DATASET (CPU pass: a prepared char-level dataset instead of data/shakespeare_char).
set -uo pipefail
export PYTHONUNBUFFERED=1

CALLER_PWD=$PWD
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
CPU_MODE=${GPU_CHECK_CPU:-0}
BUDGET=${GPU_CHECK_BUDGET:-460}
PARTS=${GPU_CHECK_PARTS:-tests,compile,decode,memory,bench,speedrun}
RESULTS=""
SUMMARY_RESERVE=15  # seconds kept back for the summary

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while (($#)); do
    case $1 in
        --cpu | --dry-run) CPU_MODE=1 ;;
        --results) RESULTS=${2:?--results needs a folder}; shift ;;
        --results=*) RESULTS=${1#--results=} ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (--cpu, --results DIR, --help)" >&2; exit 2 ;;
    esac
    shift
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
dry_run_folder() { mktemp -d "${TMPDIR:-/tmp}/gpu_check_results.XXXXXX"; }
RESULTS_DEFAULT=0
if [[ -z $RESULTS ]]; then  # the CPU pass is a dry run: it leaves bench_results/ alone
    RESULTS_DEFAULT=1
    if [[ $CPU_MODE == 1 ]]; then RESULTS=$(dry_run_folder) || exit 2; else RESULTS=bench_results; fi
fi
[[ $RESULTS == /* ]] || [[ $RESULTS == bench_results ]] || RESULTS=$CALLER_PWD/$RESULTS
mkdir -p "$RESULTS" || exit 2
RESULTS=$(cd "$RESULTS" && pwd)
# the CPU pass: one thread (on a shared CPU, two threads waiting on each other can be 50x slower)
# and the dataset override, if any
CPU_DATA=(--threads=1)
[[ -n ${GPU_CHECK_DATASET:-} ]] && CPU_DATA+=("--dataset=$GPU_CHECK_DATASET")
PARTS_TSV=$WORK/parts.tsv
: >"$PARTS_TSV"
echo "cpu-check" >"$WORK/slug"
echo "$RESULTS" >"$WORK/results"  # main runs in a pipeline (a subshell): what it changes, it writes

say() { printf '%s\n' "$*"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$PARTS_TSV"; }
skip() { say "SKIP $1: $2"; record "$1" skipped 0 "$2"; }
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }

# to $OUT/bench_results/ as it appears: the summary's page, record and log, and one archive of
# every file this run wrote (the lent machine hands back at most 8 files from $OUT)
copy_out() {
    [[ -n ${OUT:-} ]] || return 0
    mkdir -p "$OUT/bench_results" || return 0
    local f
    for f in "$RESULTS/gpu_check_$SLUG".{md,json,log}; do
        [[ -f $f ]] && cp -f "$f" "$OUT/bench_results/"
    done
    (cd "$RESULTS" && find . -maxdepth 1 -type f -name "*$SLUG*" -printf '%f\0' \
        | tar --null -czf "$OUT/bench_results/gpu_check_${SLUG}_all.tar.gz" -T -)
}

# begin NAME CAP: sets LIMIT to the part's seconds (its cap, or what is left of the budget);
# false (and a SKIP line) when too little is left
begin() {
    local remaining=$((BUDGET - SECONDS - SUMMARY_RESERVE))
    LIMIT=$(($2 < remaining ? $2 : remaining))
    if ((LIMIT < 25)); then
        skip "$1" "the ${BUDGET} s budget is spent (GPU_CHECK_BUDGET)"
        return 1
    fi
    say ""
    say "== $1 (at most ${LIMIT} s, $((SECONDS)) s so far) =="
    PART_START=$SECONDS
}

# finish NAME RC [NOTE]: record how the part ended
finish() {
    local took=$((SECONDS - PART_START)) status note=${3:-}
    case $2 in
        0) status=ok ;;
        124 | 137) status=timeout; note="stopped at its ${LIMIT} s limit${note:+; $note}" ;;
        *) status=failed; note="exit status $2${note:+; $note}" ;;
    esac
    say "-- $1: $status in ${took} s${note:+ ($note)}"
    record "$1" "$status" "$took" "$note"
    copy_out
}

limited() {  # limited CMD...: run under what is left of the part's time limit (a part that runs
    # two commands gives the second only what the first left, so the part ends within its limit)
    local left=$((LIMIT - (SECONDS - ${PART_START:-$SECONDS})))
    if ((left < 5)); then
        say "not run (the part's ${LIMIT} s are spent): $*"
        return 124
    fi
    if command -v timeout >/dev/null; then
        timeout -k 10 "$left" "$@"
    else
        "$@"
    fi
}

nvidia_smi() {  # the GPUs as nvidia-smi lists them, for the env part
    command -v nvidia-smi >/dev/null || { echo "not found"; return; }
    local out
    if out=$(limited nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader 2>&1) && [[ -n $out ]]; then
        echo "${out//$'\n'/; }"
    else
        echo "failed (${out:0:200})"
    fi
}

part_env() {
    begin env 60 || return
    local args=(--json "$WORK/env.json" --shell "$WORK/env.sh" --nvidia-smi "$(nvidia_smi)")
    [[ $CPU_MODE == 1 ]] && args+=(--cpu)
    limited "$PYTHON" scripts/gpu_check_report.py env "${args[@]}"
    local rc=$?
    command -v timeout >/dev/null || say "timeout (coreutils) not found: parts run without limits"
    # shellcheck disable=SC1091
    [[ $rc == 0 ]] && source "$WORK/env.sh"
    SLUG=$GC_SLUG
    echo "$SLUG" >"$WORK/slug"
    cp -f "$WORK/env.json" "$RESULTS/gpu_check_${SLUG}_env.json" 2>/dev/null
    if [[ $CPU_MODE != 1 && $GC_HAS_CUDA != 1 ]]; then
        say "no CUDA device here: making the CPU pass instead (tiny sizes, as with --cpu)"
        CPU_MODE=1
        if [[ $RESULTS_DEFAULT == 1 ]]; then  # a dry run's files stay out of bench_results/
            local folder
            folder=$(dry_run_folder) && mv -f "$RESULTS/gpu_check_${SLUG}_env.json" "$folder/"
            RESULTS=$folder
            echo "$RESULTS" >"$WORK/results"
            say "results of the CPU pass in $RESULTS"
        fi
    fi
    finish env "$rc"
}

find_pytest() {
    "$PYTHON" -c 'import pytest' 2>/dev/null && return 0
    [[ -n ${GPU_CHECK_WHEELS:-} ]] || return 1
    say "pytest is missing: installing it offline from $GPU_CHECK_WHEELS"
    "$PYTHON" -m pip install --quiet --no-index --find-links "$GPU_CHECK_WHEELS" \
        --target "$WORK/pylib" pytest || return 1
    "$PYTHON" -m pip install --quiet --no-index --find-links "$GPU_CHECK_WHEELS" \
        --target "$WORK/pylib" --no-deps pytest-timeout 2>/dev/null ||
        say "no pytest-timeout wheel in $GPU_CHECK_WHEELS"
    export PYTHONPATH=$WORK/pylib${PYTHONPATH:+:$PYTHONPATH}
    "$PYTHON" -c 'import pytest' 2>/dev/null
}

# pyproject.toml requires pytest-timeout; without it the CUDA tests still run, under the part's
# own limit, with the other strict settings
pytest_settings() {
    "$PYTHON" -c 'import pytest_timeout' 2>/dev/null && return
    say "pytest-timeout is missing: the CUDA tests run without the per-test timeout" >&2
    echo "-o required_plugins= -o addopts=--strict-markers"
}

part_tests() {
    if ! find_pytest; then
        skip tests "pytest is not installed for $PYTHON (python3 -m pip install pytest, or carry its wheels and set GPU_CHECK_WHEELS=DIR)"
        return
    fi
    begin tests 120 || return
    local targets=${GPU_CHECK_TESTS:-tests}
    [[ $GC_HAS_CUDA == 1 ]] ||
        say "no CUDA device: running the CUDA selection anyway; every test in it must skip"
    local settings
    settings=$(pytest_settings)
    # shellcheck disable=SC2086
    limited "$PYTHON" -m pytest -m cuda -q -rfEs -p no:cacheprovider $settings \
        --continue-on-collection-errors --junitxml="$RESULTS/gpu_check_${SLUG}_tests.xml" \
        $targets
    local rc=$?
    if [[ $rc == 0 && $GC_HAS_CUDA != 1 ]]; then
        local why="no CUDA device: the -m cuda selection was collected and every test in it skipped"
        say "SKIP tests: $why"
        record tests skipped $((SECONDS - PART_START)) "$why"
        copy_out
        return
    fi
    finish tests $rc
}

# watch_compile: train.py's output passed on; what it says about compiling goes to
# $WORK/compile_note: the warm-up's seconds (from its "compiling:" line to the next line) and each
# step's time (a first step much slower than the second compiled again)
watch_compile() {
    local line start="" note=""
    while IFS= read -r line; do
        printf '%s\n' "$line"
        if [[ -n $start ]]; then
            note="torch.compile warm-up $((SECONDS - start)) s"
            start=""
        fi
        [[ $line == compiling:* ]] && start=$SECONDS
        if [[ $line =~ ^step\ +([0-9]+)\ \|.*\|\ ([0-9,.]+)\ ms\ \| ]]; then
            note+="${note:+, }step ${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ms"
        fi
        printf '%s' "$note" >"$WORK/compile_note"
    done
}

part_compile() {
    begin compile 120 || return
    # the speedrun part's gpt2_124m run, stopped after 2 steps and never evaluated (the warm-up
    # compiles the eval step too): the same shapes, so that part reuses these compiled graphs
    local args=(--config gpt2_124m --save_checkpoints=false --hellaswag_interval=0
                --tokens_per_step=0 --grad_accum_steps=1 --log_interval=1 --eval_iters=4
                --eval_at_start=false --stop_after_iters=2 --out_dir="$WORK/compile") why=""
    if [[ $CPU_MODE == 1 ]]; then
        why="CPU pass: --compile=false (TorchInductor's C++ build takes ~30 s here even at tiny size; tests/test_speedups.py and the golden runs compile on the CPU)"
        say "compile: $why"
        args+=(--compile=false --device=cpu --vocab_size=0 --dataset=shakespeare_char
               --n_layer=1 --n_head=2 --n_embd=32 --block_size=32 --batch_size=2 --max_iters=3
               --eval_interval=3 "${CPU_DATA[@]}")
    else  # 8 x 1024 tokens a step, as the speedrun part's runs
        args+=(--compile=true --dataset=shakespeare --batch_size=8 --max_iters=40
               --eval_interval=20)
    fi
    : >"$WORK/compile_note"
    limited "$PYTHON" train.py "${args[@]}" 2>&1 | watch_compile
    local rc=${PIPESTATUS[0]} note
    note=$(cat "$WORK/compile_note")
    finish compile "$rc" "${why:+$why; }${note}"
}

part_decode() {
    begin decode 60 || return
    local args=(--part decode --results "$RESULTS" --name "${SLUG}_decode")
    if [[ $CPU_MODE == 1 ]]; then
        args+=(--device=cpu --decode-model tiny --decode-tokens 8 --prompt-tokens 4 "${CPU_DATA[@]}")
    else
        args+=(--decode-model gpt2 --decode-tokens 64)
    fi
    limited "$PYTHON" bench.py memory "${args[@]}"
    local rc=$?
    if [[ $CPU_MODE != 1 ]]; then  # GPT-2 124M block shapes, pruned: sparse kernels vs dense
        limited "$PYTHON" -m engine.inference.sparse --device=cuda --rows=1,16,256,4096 --repeats=5 \
            --threads=0 --out="$RESULTS/prune_sparse_${SLUG}" || rc=$?
    fi
    finish decode $rc
}

part_memory() {
    begin memory 80 || return
    local args=(--part train --steps 1 --grad_accum_steps=1 --time-budget $((LIMIT - 10))
                --results "$RESULTS" --name "${SLUG}_train")
    if [[ $CPU_MODE == 1 ]]; then
        args+=(--device=cpu --rows baseline,empty_cache=off,prefetch=on --batch_size=2
               --block_size=64 "${CPU_DATA[@]}")
    else  # GPT-2 124M (configs/bench_gpu.toml), 8 x 1024 tokens, the CUDA-only rows included
        args+=(--batch_size=8 --rows baseline,checkpointing=all,checkpointing=attention,dtype=bfloat16,dtype+weights_dtype=bfloat16,empty_cache=off,prefetch=on)
    fi
    limited "$PYTHON" bench.py memory "${args[@]}"
    finish memory $?
}

part_bench() {
    begin bench 180 || return
    local args=(--time-budget $((LIMIT - 15)) --results "$RESULTS" --name "gpu_check_${SLUG}_bench")
    if [[ $CPU_MODE == 1 ]]; then
        args+=(--device=cpu --order tf32 --warmup-steps 1 --measure-steps 1 --kernels off
               --ceiling-size 256 --n_layer=1 --n_head=2 --n_embd=32 --block_size=32
               --batch_size=2 --grad_accum_steps=1 "${CPU_DATA[@]}")
    else
        # configs/bench_gpu.toml (GPT-2 124M, context 1024) at 8 x 2 sequences per step; compile
        # last, so only one row pays for compiling; batch_size_auto finds 16 x 1 on an H200;
        # chunked_loss and muon: what the chunked head and Muon's Newton-Schulz cost per step
        args+=(--order causal_mask,tf32,fused_adamw,pin_memory,dtype,norm_gelu,attention,vocab_pad,batch_size_auto,chunked_loss,muon,compile
               --warmup-steps 1 --measure-steps 3 --batch_size=8 --grad_accum_steps=2)
    fi
    limited "$PYTHON" bench.py ablation "${args[@]}"
    finish bench $?
}

part_speedrun() {
    begin speedrun 110 || return
    local common=(--save_checkpoints=false --hellaswag_interval=0 --tokens_per_step=0
                  --grad_accum_steps=1 --log_interval=1 --eval_iters=4) rc=0 runs=()
    if [[ $CPU_MODE == 1 ]]; then
        common+=(--device=cpu --compile=false --vocab_size=0 --dataset=shakespeare_char
                 --n_layer=1 --n_head=2 --n_embd=32 --block_size=32 --batch_size=2
                 --max_iters=3 --eval_interval=3 "${CPU_DATA[@]}")
    else  # 8 x 1024 tokens a step on data the machine has (no FineWeb-Edu offline)
        common+=(--dataset=shakespeare --batch_size=8 --max_iters=40 --eval_interval=20)
    fi
    for config in gpt2_124m gpt2_124m_speedrun; do
        limited "$PYTHON" train.py --config "$config" "${common[@]}" \
            --out_dir="$WORK/speedrun/$config" || rc=$?
        runs+=("$config=$WORK/speedrun/$config")
    done
    "$PYTHON" scripts/gpu_check_report.py speedrun --runs "$(IFS=,; echo "${runs[*]}")" \
        --out "$RESULTS/gpu_check_${SLUG}_speedrun" || rc=$?
    finish speedrun $rc
}

part_summary() {
    say ""
    say "== summary =="
    LIMIT=30 PART_START=$SECONDS
    limited "$PYTHON" scripts/gpu_check_report.py summary --results "$RESULTS" --slug "$SLUG" \
        --env "$WORK/env.json" --parts "$PARTS_TSV" --budget "$BUDGET"
    local rc=$?
    copy_out
    return $rc
}

main() {
    SLUG=cpu-check
    # what the env part finds out; until then, as if nothing were there
    GC_SLUG=cpu-check GC_HAS_CUDA=0 GC_HAS_TIKTOKEN=0
    GC_CANNOT_RUN="the env part did not finish: what this machine has is unknown"
    say "gpu_check: results in $RESULTS, budget ${BUDGET} s, python: $PYTHON"
    part_env
    if [[ -n $GC_CANNOT_RUN ]]; then
        for part in tests compile decode memory bench speedrun; do
            wanted $part && skip $part "$GC_CANNOT_RUN"
        done
    else
        if [[ $CPU_MODE == 1 ]]; then
            say "SKIP the GPU sizes (GPT-2 124M at context 1024): CPU pass, every part runs at tiny size on the CPU and its CUDA-only rows say 'needs CUDA'"
        fi
        for part in tests compile decode memory bench speedrun; do
            if ! wanted $part; then
                skip $part "not in GPU_CHECK_PARTS=$PARTS"
            elif [[ $part != tests && $CPU_MODE != 1 && $GC_HAS_TIKTOKEN != 1 ]]; then
                skip $part "tiktoken is not installed for $PYTHON: configs/bench_gpu.toml's data is in GPT-2 tokens"
            else
                "part_$part"
            fi
        done
    fi
    part_summary || say "summary failed"
    say ""
    say "gpu_check: done in ${SECONDS} s; results in $RESULTS"
    awk -F'\t' '$2 == "failed" || $2 == "timeout" { bad = 1 } END { exit bad }' "$PARTS_TSV"
}

main 2>&1 | tee "$WORK/console.log"
rc=${PIPESTATUS[0]}
SLUG=$(cat "$WORK/slug")
RESULTS=$(cat "$WORK/results")
cp -f "$WORK/console.log" "$RESULTS/gpu_check_${SLUG}.log"
copy_out
exit "$rc"
