#!/usr/bin/env bash
# The GPU checks a session with a lent GPU runs, in one call, stage by stage:
#
#   bash scripts/gpu_checks.sh native mosaic mixed matmul engine-ab
#
# native   : every native Pallas kernel test, float8 pools and the experts' kernel too (8 pytest
#            workers sharing the GPU, so the Triton compilations run side by side; ~90 s on an H100)
# mosaic   : the compiled Mosaic GPU stacked matmul against XLA's matmul at Llama-3-8B shapes
# mixed    : bench_gpu --only mixed (a busy mixed step's attention, every way, incl. the
#            longest-first block order)
# matmul   : bench_gpu --only matmul at 128-2,048 tokens (Triton, Mosaic GPU and XLA)
# moe      : bench_gpu --only moe (one mixture-of-experts layer: the Triton kernel vs XLA's ragged dot)
# tune     : bench_gpu --only tune (decode and ragged kernel knobs at the engine's shapes)
# profile  : bench_gpu --only decode-profile (decode steps of 4-256 sequences, traced)
# engine-ab: --only llama8b --lean, the defaults then each opt-in switch in $AB (default:
#            "--stacked-kernel auto" and "--block-order longest_first"), then the
#            defaults again, all on this machine; AB_ROUNDS=2 alternates twice, and
#            AB_REQUESTS=500 halves each run. One run of 1,000 requests takes ~130-190 s
#            on an H100 (a full warm-up pass, then the timed run): keep BENCH_S at its
#            300 s, and plan three such runs per 600 s call (five of 500 requests)
#
# Logs go to $OUT (the device tool's folder) or bench_out/. The repository is on
# PYTHONPATH (the device machine has jax and flax preinstalled and reaches no registry).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXPAGED_CACHE_DIR=${JAXPAGED_CACHE_DIR:-/tmp/jaxpaged_cc}
out=${OUT:-bench_out}
mkdir -p "$out"
quiet='^Finished|^Compiling|Persistent compilation|DeprecationWarning|stats = dict|PytestBenchmarkWarning|warner\('

bench() {  # bench NAME ARGS...: one bench_gpu.py process, its log and json kept under NAME
    local name=$1; shift
    (cd scripts && timeout "${BENCH_S:-300}" python3 bench_gpu.py "$@" 2>&1) | grep --line-buffered -v -E "$quiet" \
        | tee "$out/$name.txt"
    cp bench_out/bench_gpu.json "$out/$name.json" 2>/dev/null
}

for stage in "$@"; do
    t0=$(date +%s)
    echo "=== $stage"
    case $stage in
        native)
            XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider \
                tests/test_kernels.py tests/test_kv_fp8.py tests/test_moe.py -k "Native or native" 2>&1 \
                | grep -v -E "$quiet" | tail -15 \
                | tee "$out/native.txt" ;;
        mosaic)
            timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_stacked_matmul.py -k mosaic_native 2>&1 \
                | grep -v -E "$quiet" | tail -25 | tee "$out/mosaic.txt" ;;
        mixed) bench mixed --only mixed ;;
        matmul) bench matmul --only matmul --matmul-tokens 128,256,512,1024,2048 ;;
        moe) bench moe --only moe ;;
        tune) bench tune --only tune ;;
        profile) bench profile --only decode-profile ;;
        engine-ab)
            IFS=';' read -r -a switches <<< "${AB:---stacked-kernel auto;--block-order longest_first}"
            n=(--only llama8b --lean --num-requests "${AB_REQUESTS:-1000}")
            for r in $(seq "${AB_ROUNDS:-1}"); do
                bench "engine_default_r$r" "${n[@]}"
                i=0
                for sw in "${switches[@]}"; do
                    i=$((i + 1))
                    # shellcheck disable=SC2086  # the switch is words
                    bench "engine_ab${i}_r$r" "${n[@]}" $sw
                done
            done
            bench engine_default_last "${n[@]}"
            grep -h -E "^# bench_gpu|^jaxpaged \(this run\)" "$out"/engine_*.txt ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac
    echo "=== $stage: $(( $(date +%s) - t0 )) s"
done
