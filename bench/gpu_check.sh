#!/usr/bin/env bash
# The GPU checks in one run, on a machine with an NVIDIA GPU and a Python that
# has torch, triton and pytest. A machine without a package index can take
# gguf as a wheel prepared beside the checkout:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# Then:
#   bash bench/gpu_check.sh            # each step under its own timeout, 8 minutes at most
# It runs every GPU-marked test with compiled kernels (kernels_test/ and
# tests/), then the benchmarks the GPU-kernel issue asks for, each kernel
# timed alone in a CUDA graph (the word GEMV and the prompt path against the
# older kernels and dense bf16; decode attention per KV format; the experts),
# writing each output to $OUT (default bench/results/gpu-<date>/). A session
# lent a GPU has 15 minutes of it in all: this fits one run and a rerun.
# GPU_CHECK_BENCH_ONLY=1 skips the tests, to rerun the benchmarks alone;
# GPU_CHECK_FULL=1 adds the older benchmarks (microbenchmarks, the GEMV/GEMM
# crossover, qmatmul on GGUF blocks, the recurrent layers), about 8 minutes more.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu-$(date +%F)}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"

if [ -z "${GPU_CHECK_BENCH_ONLY:-}" ]; then
    # 1. GPU-marked kernel tests (the compiled dp2a/prmt forms against the plain ones, bf16, large
    #    shapes, attention at 4K/32K), microbenchmarks apart.
    timeout 150 python3 -m pytest -m gpu kernels_test -q -x -p no:cacheprovider --benchmark-skip -rs 2>&1 \
        | tail -30 | tee "$out/gpu-tests.txt"
    # 2. Every GPU-marked runtime test: dense (word planes), MoE and hybrid families, the conversation
    #    cache on CUDA (pinned pool, copy stream), splits across devices.
    timeout 120 python3 -m pytest -m gpu tests -q -x -p no:cacheprovider -rs 2>&1 | tail -30 \
        | tee "$out/gpu-tests-runtime.txt"
fi
# 3. The word-layout GEMV (M = 1, 8) and the prompt path (M = 512) against the older kernels and dense bf16.
timeout 120 python3 bench/gemv_words.py --m 1,8 --prompt-m 512 --csv "$out/gemv-words.csv" 2>&1 \
    | tee "$out/gemv-words.txt"
# 4. Decode attention per KV format at 4K-128K, the kernels alone.
timeout 45 python3 bench/attention.py 2>&1 | tee "$out/attention.txt"
# 5. Mixture-of-experts matmuls: 128 experts of 768x2048, top-8, M = 1, 8, 512.
timeout 45 python3 bench/experts.py --types Q4_K,Q8_0 2>&1 | tee "$out/experts.txt"
if [ -n "${GPU_CHECK_FULL:-}" ]; then
    timeout 150 python3 -m pytest -m gpu kernels_test/test_kernel_benchmarks.py -q -p no:cacheprovider \
        --benchmark-only --benchmark-json="$out/microbenchmarks.json" --benchmark-columns=min,median,rounds 2>&1 \
        | tail -60 | tee "$out/microbenchmarks.txt"
    timeout 90 python3 bench/kernels.py --crossover --types Q4_K,Q8_0,IQ4_XS,IQ3_S 2>&1 | tee "$out/crossover.txt"
    timeout 120 python3 bench/kernels.py --types Q4_K,Q8_0,IQ4_XS,IQ3_S,Q6_K --shapes 4096x14336,14336x4096 \
        --m 1,8,64,512 --csv "$out/kernels-cuda.csv" 2>&1 | tee "$out/kernels.txt"
    timeout 60 python3 bench/recurrent.py 2>&1 | tee "$out/recurrent.txt"
fi
