"""Would adopting a `below` file's (or store chunk's) blocks pay? (issue 34)

A `below` file is coded with portable statistics (float64 maths, the settled listing, `lanes`); generation codes
with float32 statistics, so a load decodes every block with the portable session and codes it again. Adopting
the file's blocks instead would decode them with the portable session at every step. This times, side by side
on one thread (alternating, medians), for SmolLM2 at ``--tokens`` held-out tokens:

- ``encode``: coding every block of every layer (generation's float32 session vs the portable one);
- ``decode``: decoding every block of every layer from fresh codecs, layer by layer as a step does;

and a third coding, generation's with the codec's built-in p_hat instead of the calibration's marginals (what a
format that holds no marginals would cost in bits).

The bits of both codings are printed too. Needs the model's default calibration with ``below`` heads (set
``HF_KVCOMPRESS_CACHE`` to a folder holding one, or let `calibration_for` fit it).

    python experiments/below_adopt_cost.py [--tokens 2048] [--repeats 3] [--coder lanes]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_kvcompress import LosslessConfig
from hf_kvcompress.blockcodec import BlockCodec
from hf_kvcompress.calibration import calibration_for
from hf_kvcompress.predictors import make_predictor
from hf_kvcompress_eval.bench.common import workload

#: the codings compared: (portable statistics, the calibration's marginals)
CODINGS = {"generation": (False, True), "portable (file)": (True, True), "generation, default p_hat": (False, False)}


def codec(calibration, coding: str, coder: str, blocks: dict) -> BlockCodec:
    portable, marginals = CODINGS[coding]
    settings = LosslessConfig(predictor="below", coder=coder)
    predictor = make_predictor("below", calibration=calibration, portable=portable)
    found = BlockCodec.over(settings, predictor, calibration, lambda layer, start: blocks.get((layer, start)))
    found.layer_count = int(calibration.meta["model"]["layers"])
    if not marginals:  # the codec's built-in p_hat for escapes: what not holding the calibration's would code
        found.marginals = None
    return found


def encode_all(calibration, coding: str, coder: str, kv: list, block: int) -> tuple[dict, float]:
    blocks: dict = {}
    writer = codec(calibration, coding, coder, blocks)
    start = time.process_time()
    for layer, (k, v) in enumerate(kv):
        for s in range(0, k.shape[2] - block + 1, block):
            blocks[(layer, s)] = writer.encode_block(layer, k[:, :, s : s + block], v[:, :, s : s + block], s)
    return blocks, time.process_time() - start


def decode_all(calibration, coding: str, coder: str, blocks: dict, layers: int) -> float:
    reader = codec(calibration, coding, coder, blocks)
    start = time.process_time()
    for layer in range(layers):
        reader.decoded_layer([b for (i, _), b in sorted(blocks.items()) if i == layer])
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coder", default="lanes")
    parser.add_argument("--block", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = workload(False)
    calibration, note = calibration_for(work.model, tokenizer=work.tokenizer, predictors=("below",))
    print(f"calibration: {note}")
    reference = DynamicCache(config=work.model.config)
    with torch.no_grad():
        work.model(work.ids(args.tokens), cache=reference, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in reference.layers]
    scalars = sum(k.numel() + v.numel() for k, v in kv)
    times: dict[str, list[float]] = {}
    coded = {}
    for _ in range(args.repeats):
        for name in CODINGS:
            blocks, seconds = encode_all(calibration, name, args.coder, kv, args.block)
            coded[name] = blocks
            times.setdefault(f"encode {name}", []).append(seconds)
            times.setdefault(f"decode {name}", []).append(decode_all(calibration, name, args.coder, blocks, len(kv)))
    print(f"SmolLM2 bf16, {args.tokens} tokens, coder {args.coder}, 1 thread, CPU seconds (median of {args.repeats})")
    print("| coding | bits | encode s | decode s | decode x generation's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(times["decode generation"])
    for name, blocks in coded.items():
        bits = 8.0 * sum(b.nbytes() for b in blocks.values()) / scalars
        decode = statistics.median(times[f"decode {name}"])
        print(f"| {name} | {bits:.3f} | {statistics.median(times[f'encode {name}']):.2f} | {decode:.2f} | "
              f"{decode / base:.2f} |")


if __name__ == "__main__":
    main()
