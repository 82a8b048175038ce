#!/usr/bin/env bash
# The GPU checks in one run, for the device tool's H200 (its python3 has torch,
# triton and pytest; gguf travels as a wheel). Prepare once, here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# then run with carry [".whl"] and a 540 s timeout:
#   bash bench/gpu_check.sh
# It runs every GPU-marked kernel test, then the benchmarks the kernel and KV
# issues ask for (their large shapes only, to fit the 15-minute budget), and
# writes each output to $OUT (default bench/results/gpu-<date>/) for committing.
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

# 1. GPU-marked kernel tests (bf16, large shapes, the attention kernels at 4K/32K).
# (GPU_CHECK_BENCH_ONLY=1 skips them, to rerun the benchmarks alone inside the budget.)
if [ -z "${GPU_CHECK_BENCH_ONLY:-}" ]; then
    timeout 240 python3 -m pytest -m gpu kernels_test -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$out/gpu-tests.txt"
fi
# 1b. Every dense family and the conversation cache on CUDA, on tiny files the tests write.
if [ -z "${GPU_CHECK_BENCH_ONLY:-}" ]; then
    timeout 150 python3 -m pytest -m gpu tests/test_cuda_families.py -q -x -p no:cacheprovider -rs 2>&1 | tail -30 | tee "$out/gpu-tests-families.txt"
fi
# 2. The GEMV/GEMM crossover (sets launch.GEMV_MAX_M).
timeout 90 python3 bench/kernels.py --crossover --types Q4_K,Q8_0,IQ4_XS,IQ3_S 2>&1 | tee "$out/crossover.txt"
# 3. qmatmul against the copy bandwidth and a bf16 matmul, the issue's target shape class.
timeout 120 python3 bench/kernels.py --types Q4_K,Q8_0,IQ4_XS,IQ3_S,Q6_K --shapes 4096x14336,14336x4096 \
    --m 1,8,64,512 --csv "$out/kernels-cuda.csv" 2>&1 | tee "$out/kernels.txt"
# 4. Decode attention per KV format at 4K-128K.
timeout 60 python3 bench/attention.py 2>&1 | tee "$out/attention.txt"
# 5. Mixture-of-experts matmuls: 128 experts of 768x2048, top-8, M = 1, 8, 512.
timeout 60 python3 bench/experts.py --types Q4_K,Q8_0 2>&1 | tee "$out/experts.txt"
# 6. Recurrent layers (Gated DeltaNet): decode step against the bandwidth bound, chunked prefill.
timeout 60 python3 bench/recurrent.py 2>&1 | tee "$out/recurrent.txt"
