"""The binding's margin on the embedded model, keys and values (docs/prefix_store.md "Trust"; issue 47).

SmolLM2-135M-Instruct bf16, one torch thread. Three numbers per tensor (layer 0's keys, layer 0's values), each the
largest difference over a head's channels relative to that head's largest |entry|, as `binding.first_disagreement`
measures it:
- ``same``: the same tokens computed two ways: a 512-token prefill's K/V against decode steps (one token a step
  after a 256-token prefill): what the tolerance must admit;
- ``nearest token``: a 1,500-token sample of the vocabulary at one position after a shared context: per token, the
  closest other token (min over others of the max over heads): what a planted token must beat;
- ``other prompt``: a 512-token prompt's K/V against another prompt's at the same positions: the median over
  tokens, and the share within the tolerance (a position where both prompts hold the same token agrees exactly).
Writes ``results/store_binding/margin.json``.

    python experiments/binding_margin.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcompress.cache.binding import tolerance
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.rerun import first_kv


def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token and head: max |a - b| over channels / max |a| over the head's channels; max over heads."""
    a, b = a.float(), b.float()
    err = (a - b).abs().amax(dim=-1) / a.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return err.amax(dim=1)  # [rows, tokens]


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    ids = token_ids(tokenizer, 1024)
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        _, keys, values = first_kv(model, ids[:, :512])
        cache = DynamicCache()
        model(ids[:, :256], cache=cache, use_cache=True)
        for t in range(256, 512):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
        layer = cache.layers[0]
        same = {"keys": relative(keys, layer.keys), "values": relative(values, layer.values)}
        vocab = model.config.vocab_size
        sample = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:1500]
        context = ids[:, :32].repeat(len(sample), 1)
        batch = torch.cat([context, sample[:, None]], dim=1)
        _, k_tok, v_tok = first_kv(model, batch)
        other_prompt = ids[:, 512:1024]
        _, k_other, v_other = first_kv(model, other_prompt)
    for name, got, tokens, other in (("keys", same["keys"], k_tok[:, :, -1], k_other),
                                     ("values", same["values"], v_tok[:, :, -1], v_other)):
        flat = tokens.float()  # [n, heads, dim]
        scale = flat.abs().amax(dim=-1)  # [n, heads]
        nearest = torch.full((len(flat),), float("inf"))
        for i in range(len(flat)):
            diff = (flat - flat[i]).abs().amax(dim=-1) / scale[i].clamp_min(1e-30)  # [n, heads]
            per = diff.amax(dim=1)
            per[i] = float("inf")
            nearest[i] = per.min()
        prompt = relative(keys if name == "keys" else values, other)
        out[name] = {"same_max": float(got.max()), "nearest_token_min": float(nearest.min()),
                     "nearest_token_median": float(nearest.median()),
                     "nearest_token_within_tolerance": float((nearest <= tolerance(keys.dtype)).float().mean()), "other_prompt_median": float(prompt.median()),
                     "other_prompt_within_tolerance": float((prompt <= tolerance(keys.dtype)).float().mean()), "tolerance": tolerance(keys.dtype)}
        print(name, {k: round(v, 5) for k, v in out[name].items()})
    target = Path(__file__).resolve().parents[1] / "results" / "store_binding" / "margin.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
