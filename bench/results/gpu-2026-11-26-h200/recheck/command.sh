#!/bin/bash
# The second GPU call of 2026-11-26: the fixed tests, the GEMM's accuracy, where host time goes, memcheck.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/device.txt
timeout 140 python3 -m pytest -q -rfE -p no:cacheprovider -n 12 --dist loadfile \
  tests/test_gpu_gemm.py tests/test_gpu_blocks.py tests/test_gemm.py tests/test_blocks.py \
  tests/test_jax_fastpaths.py tests/test_jax_devices.py tests/test_fastpath.py tests/test_hostile_jax.py \
  tests/test_blocks_frontends.py tests/test_jax_frontend.py tests/test_jax_batch.py tests/test_flax_shapes.py \
  tests/test_flax_convert.py tests/test_out.py tests/test_interop.py tests/test_cupy_capture.py \
  tests/test_release.py tests/test_blocks_tiled.py tests/test_gpu_torch.py tests/test_gpu_torch_blocks.py \
  tests/test_torch_distributed.py > $R/tests.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $R/tests.log | cut -c1-200 | tail -40
timeout 30 python3 bench/bench_gemm_accuracy.py --json $R/gemm_accuracy.json > $R/gemm_accuracy.txt 2>&1
cut -c1-130 $R/gemm_accuracy.txt
timeout 20 python3 bench/bench_overhead.py --gpu --cprofile quantize --repeat 2000 > $R/cprofile_quantize.txt 2>&1
timeout 20 python3 bench/bench_overhead.py --gpu --cprofile gemm --repeat 2000 > $R/cprofile_gemm.txt 2>&1
head -45 $R/cprofile_quantize.txt | cut -c1-150
PYTHONPATH=bench:$PYTHONPATH FP8CORE_GPU_RUN_SANITIZER=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 30 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 30 python3 -m pytest -q -p no:cacheprovider \
  -p gpu_run tests/test_gpu.py -k "not over_2_31 and not cuda_graph and not capture" > $R/memcheck.log 2>&1
echo "memcheck rc $?"; grep -E "ERROR SUMMARY|passed|failed" $R/memcheck.log
