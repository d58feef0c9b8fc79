#!/usr/bin/env bash
# The GPU runs, batched into few long commands (a lent GPU is billed while held):
#
#   bash benchmarks/gpu.sh seeds OUT   # the tiny default on CUDA (bf16 autocast), seeds 0-4 side by side, + demo answers
#   bash benchmarks/gpu.sh speed OUT   # decode, time to first token, training throughput and serving, side by side
#   bash benchmarks/gpu.sh serving OUT # issue 41: the engine's GPU tests (CUDA graphs, no syncs), then serving at
#                                      # 256 and 1,024 requests and nano-vllm's workload against static and transformers
#   bash benchmarks/gpu.sh engine OUT  # issues 41/58 (~9.5 min): the GPU tests, the engine (default: overlapped
#                                      # steps) against the compiled static batch at 256 requests, then serial and
#                                      # compiled (the decode captured, the prompt chunks compiled; the longest
#                                      # start-up, last: a time-out keeps the rows before it), and the compiled
#                                      # engine's decode step split into host and device time, serial and overlapped
#   bash benchmarks/gpu.sh fast OUT    # issues 44 and 46 (~8 min): QLoRA's GPU test; decode with fused projections
#                                      # at batch 1 and 32 with its kernels by name, time to first token (eager,
#                                      # compiled); nanovlm-222m compiled training with the plain and the chunked
#                                      # loss, each step split into phases and kernels by kind (issue 58's profile)
#                                      # (the unfused step and transformers': results/fast-paths-cuda.md)
#   bash benchmarks/gpu.sh flex OUT    # issue 44 (~7 min): FlexAttention's GPU test (compiled, packed rows: the
#                                      # losses and gradients of SDPA under the dense mask), then nanovlm-222m
#                                      # compiled training on 512-token rows packing 4 samples, dense mask vs
#                                      # FlexAttention
#   bash benchmarks/gpu.sh quantize OUT # issue 59 (~5 min): the quantized engines' GPU test (graphs, eager tokens),
#                                      # then batch-1 decode in bfloat16 against int8 and int4 weights, side by side
#
# Each writes its tables and logs under OUT (then copy them to benchmarks/results/).
#
# The lent machines (python3 3.12, torch 2.11) have no `datasets` (training, any mode's tests) and no bitsandbytes
# (QLoRA's test). Download their wheels here first, into .whl/ (ignored through .git/info/exclude), and carry
# ".whl" with the call:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1 fsspec==2026.9.0 bitsandbytes==0.50.2 \
#     torchao==0.18.0    # quantize's (3.4 MB, no requirements; not on the lent machines; untried with torch 2.11)
#   zip -d .whl/bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*' 'bitsandbytes/libbitsandbytes_rocm*' \
#     'bitsandbytes/libbitsandbytes_xpu*'     # its CUDA 13 libraries alone: the carry's limit is 64 MiB
# They are installed into /tmp/site, with gpu_site/sitecustomize.py (see there why).
set -uo pipefail
mode=${1:?usage: benchmarks/gpu.sh seeds|speed|serving|engine|fast|flex|quantize OUT}
out=${2:?usage: benchmarks/gpu.sh seeds|speed|serving|engine|fast|flex|quantize OUT}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && cp benchmarks/gpu_site/sitecustomize.py /tmp/site/ && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
python3 - <<'EOF' 2>&1 | tee "$out/machine.txt"
import os, platform, torch, transformers
print(torch.cuda.get_device_name(), "|", os.cpu_count(), "cores |", platform.python_version(), "| torch", torch.__version__,
      "| transformers", transformers.__version__)
EOF

case $mode in
seeds)
  timeout "${SEEDS_TIMEOUT:-540}" python3 benchmarks/seeds.py --set train.device=cuda --jobs 5 --threads 2 \
    --runs runs/gpu-seeds --out "$out" 2>&1 | tee "$out/seeds.log"
  for run in runs/gpu-seeds/*/; do
    for prompt in "What color is the circle?" ""; do
      echo "$run ${prompt:-(caption)}: $(python3 generate.py --checkpoint "$run" --image "$run/heldout_example.png" \
        ${prompt:+--prompt "$prompt"} 2>&1 | tail -1)"
    done
  done 2>&1 | tee "$out/answers.log"
  ;;
speed)
  timeout 330 python3 benchmarks/decode.py --device cuda --repeats 2 --curve-tokens 16 64 256 --out "$out" 2>&1 \
    | tee "$out/decode.log"
  timeout 200 python3 benchmarks/serving.py --device cuda --workloads 64 --max-len 128 --out "$out" 2>&1 \
    | tee "$out/serving.log"
  timeout 60 python3 benchmarks/train_throughput.py --shape nanovlm-222m --device cuda --out "$out" 2>&1 \
    | tee "$out/train.log"
  ;;
serving)
  timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/serving/test_gpu.py 2>&1 \
    | tee "$out/gpu-tests.log"
  timeout "${SERVING_TIMEOUT:-450}" python3 benchmarks/serving.py --device cuda --workloads 256 1024 nanovllm \
    --max-num-seqs 256 --kv-blocks 40000 --max-batch-tokens 8192 --compile-static \
    --methods engine engine-eager static hf-one hf-cb --baseline-workloads 256 --hf-one-requests 16 --out "$out" 2>&1 \
    | tee "$out/serving.log"
  ;;
engine)  # the quantized engines' GPU tests are quantize's
  timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/serving/test_gpu.py \
    -k "not quantized" 2>&1 | tee "$out/gpu-tests.log"
  timeout "${SERVING_TIMEOUT:-270}" python3 benchmarks/serving.py --device cuda --workloads 256 \
    --max-num-seqs 256 --kv-blocks 40000 --max-batch-tokens 8192 --compile-static \
    --methods engine static engine-serial engine-compiled --out "$out" 2>&1 | tee "$out/serving.log"
  timeout "${STEP_TIMEOUT:-120}" python3 benchmarks/host_overhead.py --device cuda --model smollm2-135m --compile \
    --running 16 256 --steps 30 --profile --out "$out" 2>&1 | tee "$out/host_overhead.log"
  timeout "${STEP_TIMEOUT:-90}" python3 benchmarks/host_overhead.py --device cuda --model smollm2-135m --compile \
    --overlap --running 16 256 --steps 30 --out "$out" 2>&1 | tee -a "$out/host_overhead.log"
  ;;
fast)
  timeout "${TESTS_TIMEOUT:-60}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_lora.py 2>&1 \
    | tee "$out/gpu-tests.log"
  timeout "${DECODE_TIMEOUT:-240}" python3 benchmarks/decode.py --device cuda --batch-sizes 1 32 --repeats 2 \
    --methods "tinyvlm fused fast" --curve-tokens --out "$out" 2>&1 | tee "$out/decode.log"
  timeout "${TRAIN_TIMEOUT:-240}" python3 benchmarks/train_throughput.py --shape nanovlm-222m --device cuda --compile \
    --steps 10 --warmup 3 --profile --out "$out" 2>&1 | tee "$out/train.log"
  ;;
flex)
  timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/models/test_vision_language_model.py 2>&1 | tee "$out/gpu-tests.log"
  for flex in "" --flex; do  # rows of 512 tokens, 4 samples of 128 each: FlexAttention skips 6 of the 10 tiles
    timeout "${TRAIN_TIMEOUT:-180}" python3 benchmarks/train_throughput.py --shape nanovlm-222m --device cuda \
      --compile --batch-size 16 --seq-len 512 --packed 4 $flex --losses logits --steps 10 --warmup 3 \
      --out "$out" 2>&1 | tee -a "$out/train.log"
  done
  ;;
quantize)
  timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/serving/test_gpu.py \
    -k quantized 2>&1 | tee "$out/gpu-tests.log"
  timeout "${DECODE_TIMEOUT:-180}" python3 benchmarks/quantize.py --device cuda --dtype bfloat16 --batch-sizes 1 \
    --quantizations float int8 int4 --out "$out" 2>&1 | tee "$out/quantize.log"
  ;;
*) echo "unknown mode $mode: seeds, speed, serving, engine, fast, flex or quantize" >&2; exit 2 ;;
esac
