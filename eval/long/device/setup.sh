#!/usr/bin/env bash
# Device call 1 of 2 (eval/long/device/prepare.sh): install the carried wheels into /root/site, keep the model's first
# part in /root, and smoke the library on CUDA with a tiny random model (lossless exact, every lossy method runs).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .gpu/a/whl/*.whl || exit 3
cp .gpu/a/gguf.xz.part00 /root/ || exit 4
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 150 python3 eval/long/device/smoke.py cuda 2>&1 | tee "$OUT/smoke.log"
