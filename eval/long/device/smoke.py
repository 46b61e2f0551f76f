"""Device smoke (eval/long/device/setup.sh): the library on CUDA with a tiny random Llama (6 layers): lossless
generation bit-identical to DynamicCache's, every registered lossy method runs. One line per check; never raises,
so the run that follows learns what failed."""

from __future__ import annotations

import sys
import time
import traceback

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.registry import METHODS


def main(device: str) -> None:
    print("device", device, torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    for name in ("transformers", "numba", "numpy", "triton", "constriction", "gguf", "datasets", "pyarrow"):
        try:
            print(name, getattr(__import__(name), "__version__", "?"))
        except Exception as err:  # a missing package is reported, not fatal
            print(name, "IMPORT FAILED", repr(err)[:200])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 700), device=device)

    def generate(cache):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=24,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    ref_seq, ref_logits = generate(DynamicCache(config=cfg))
    checks = [("lossless", CompressionConfig(mode="lossless"))]
    checks += [(f"lossy {m}", CompressionConfig(mode="lossy", lossy=LossyConfig(method=m, budget=0.25))) for m in METHODS]
    for name, config in checks:
        try:
            start = time.time()
            seq, logits = generate(CompressedCache(config, model=model))
            same = torch.equal(seq, ref_seq) and torch.equal(logits.view(torch.int16), ref_logits.view(torch.int16))
            agree = (seq == ref_seq).float().mean().item()
            print(f"OK {name}: {time.time() - start:.1f}s identical={same} token agreement={agree:.3f}")
        except Exception:
            print(f"FAIL {name}:", traceback.format_exc()[-1500:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
