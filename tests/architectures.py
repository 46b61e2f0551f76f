"""Tiny random models of every decoder-only architecture transformers registers (issue 26).

`decoder_architectures()` enumerates them from transformers' own registries; `tiny_config` shrinks each to a few
seconds' worth of model (hidden 64, 4 heads, 2 KV heads, vocab 128, 6 layers, windows of 16 tokens, 4 experts of
width 32, small MLA / linear-attention / mamba dimensions) keeping its layer pattern; `tiny_model` builds one
(cached, eval mode); `matrix_architectures()` is the enumeration less `SKIPPED`, each with the reason measured
(``python tests/architectures.py`` re-measures: it builds every enumerated architecture and generates with
`DynamicCache`, reporting what fails).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

PAD, EOS, BOS = 0, 1, 2
VOCAB = 128
WINDOW = 16

#: the fields every architecture gets where its config has a field of that name (dataclass field or
#: ``attribute_map`` alias); the architecture's own `OVERRIDES` come on top
GENERIC: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "pad_token_id": PAD,
    "eos_token_id": EOS,
    "bos_token_id": BOS,
    "use_cache": True,
    "tie_word_embeddings": False,
    # windows that slide inside a 64-96 token prompt
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "attention_window_size": WINDOW,
    "window_size": WINDOW,
    "sliding_window_size": WINDOW,
    # mixtures of experts: 4 experts of width 32, 2 per token
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "top_k_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    # multi-head latent attention: query/key head dim 24 (16 + 8 rotary) != value head dim 16
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # linear attention (gated delta net) and mamba mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "mamba_d_state": 16,
    "mamba_d_head": 16,
    "mamba_n_heads": 8,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    # feed-forward widths under other names
    "dff": 128,
    "ffn_hidden_size": 128,
    "expert_ffn_hidden_size": 32,
    # Gemma 3n / 4 per-layer inputs
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
}

#: per-architecture fields on top of `GENERIC` (found by trying: each makes the tiny model build and generate
#: with DynamicCache as its full-size self does)
_S, _F = "sliding_attention", "full_attention"
OVERRIDES: dict[str, dict[str, Any]] = {
    # multi-head latent attention: as many KV heads as query heads (the latent is expanded per head)
    **{name: {"num_key_value_heads": 4} for name in (
        "axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots3_note_text",
        "glm4_moe_lite", "glm_moe_dsa", "kimi_linear", "longcat_flash", "minicpm3", "sarvam_mla", "youtu")},
    # 3 layers of 2 attention sublayers each; its rotary tables are head_dim wide
    "longcat_flash": {"num_key_value_heads": 4, "head_dim": 8, "num_layers": 3, "zero_expert_num": 2},
    # 2 layers per stack run (1 high cycle x (2 low cycles + 1)) times: 6 cache slots
    "hrm_text": {"num_hidden_layers": 2, "H_cycles": 1, "L_cycles": 2},
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", _F, "mlp", "linear_attention", _F], "n_groups": 1,
                   "chunk_size": 16},
    # rotary on part of a 16-dim head
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 6, "max_seq_len": 512,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    # mamba mixers: expand * hidden = 128 = heads * head dim
    "bamba": {"attn_layer_indices": [2, 5]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "linear_attention", _F] * 2},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 16},
    "zamba2": {"layers_block_type": ["linear_attention", "linear_attention", "hybrid"] * 2, "n_mamba_heads": 8,
               "mamba_ngroups": 1, "num_mem_blocks": 1},
    "zamba": {"attn_layer_period": 3, "attn_layer_offset": 2, "n_mamba_heads": 2},
    "zaya": {"num_experts_per_tok": 1},
    # short convolutions between attention layers
    "lfm2": {"layer_types": ["conv", "conv", _F] * 2},
    "lfm2_moe": {"layer_types": ["conv", "conv", _F, "conv", "conv", _F], "num_dense_layers": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 3]]},
    "xlnet": {"d_head": 16},
    "cohere_compass_text": {"rope_parameters": {_F: {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen4_exp_text": {"indexer_budget": 32, "indexer_compress_ratio": 4, "indexer_head_dim": 16, "indexer_n_heads": 2,
                       "indexer_kv_heads": 1},
    "dory": {"n_input_layers": 2, "n_output_layers": 2, "n_recurrent_loops": 2},
    # its indexer's heads share a key head: at most 4 / 2 query heads per key head
    "kolibri1_1": {"index_num_heads": 2},
    "inkling2_text": {"unpadded_vocab_size": VOCAB, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "swa_head_dim": 16, "d_rel": 4, "rel_extent": 32, "n_layers_per_attn_res_block": 3},
    # KV sharing: the last 2 of 6 layers read the cache of the last earlier layer of their type
    "gemma3n_text": {"layer_types": [_S, _S, _F] * 2, "num_kv_shared_layers": 2, "laurel_rank": 4,
                     "altup_num_inputs": 2, "activation_sparsity_pattern": [0.0] * 6},
    # KV sharing, and full-attention layers with twice the sliding layers' head dim
    "gemma4_text": {"layer_types": [_S, _S, _F] * 2, "num_kv_shared_layers": 2, "global_head_dim": 32},
}
OVERRIDES["inkling2_loop_text"] = {**OVERRIDES["inkling2_text"], "loop_layer_index_start": 3,
                                   "loop_layer_index_end": 6, "loop_num_passes": 2}

#: the architectures `decoder_architectures()` enumerates that the matrix leaves out, with the reason measured for
#: each (``python tests/architectures.py`` measures them again)
SKIPPED: dict[str, str] = {
    "cpmant": "DynamicCache differs from recomputing without a cache (max logit diff 0.61 at the first step)",
    "minimax": "DynamicCache refused: 'MiniMax uses cache of its own and is not compatible with `cache` of type "
               "DynamicCache'",
    "openai-gpt": "no cache: generate() refuses cache= ('The following `model_kwargs` are not used by the model: "
                  "['cache']')",
    "rwkv": "recurrent state outside the cache: DynamicCache differs from recomputing (max logit diff 0.93 at step 1)",
    "xlnet": "memory tokens, not a KV cache: DynamicCache differs from recomputing (max logit diff 0.75 at the first "
             "step)",
    "xlstm": "a cache of its own: DynamicCache fails ('DynamicCache' object has no attribute 'rnn_state')",
}


# ---------------------------------------------------------------------------------------------------- enumeration

def _config_fields(config_class: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    return names | set(getattr(config_class, "attribute_map", {}) or {})


def not_decoder_only() -> dict[str, str]:
    """Model types with a causal-LM head that are not decoder-only language models, and why (decided from the
    registries and the default configs, no model built): encoder-decoder models, encoders that also have a
    masked-LM head (their causal LM needs ``is_decoder=True``), and composite configs (multimodal or multi-part
    wrappers: their text decoders are enumerated under their own types, e.g. gemma3_text)."""
    out: dict[str, str] = {}
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    for model_type, config_class in CONFIG_MAPPING.items():
        if model_type not in causal:
            continue
        sub = dict(getattr(config_class, "sub_configs", {}) or {})
        default_encdec = _default_is_encoder_decoder(config_class)
        if default_encdec:
            out[model_type] = "encoder-decoder"
        elif model_type in masked:
            out[model_type] = "encoder with a masked-LM head (its causal LM needs is_decoder=True)"
        elif set(sub) - {"attn_config", "ffn_config"}:
            text = f"{model_type}_text" if f"{model_type}_text" in causal else None
            out[model_type] = f"composite config ({', '.join(sorted(sub))})" + (f": its text decoder is {text}"
                                                                                if text else "")
    return out


def _default_is_encoder_decoder(config_class: type) -> bool:
    try:
        return bool(getattr(config_class(), "is_encoder_decoder", False))
    except Exception:  # a config that cannot be built with its defaults: decided by the other rules
        return False


@functools.cache
def decoder_architectures() -> tuple[str, ...]:
    """Every model type in ``CONFIG_MAPPING`` with a ``MODEL_FOR_CAUSAL_LM_MAPPING`` entry that is a decoder-only
    language model (not `not_decoder_only()`), in the registry's order."""
    excluded = not_decoder_only()
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return tuple(name for name in CONFIG_MAPPING if name in causal and name not in excluded)


def matrix_architectures() -> tuple[str, ...]:
    """`decoder_architectures()` less `SKIPPED`: what the test matrix runs."""
    return tuple(name for name in decoder_architectures() if name not in SKIPPED)


# ---------------------------------------------------------------------------------------------------- tiny models

def tiny_config(model_type: str) -> PretrainedConfig:
    """A tiny config of ``model_type``: `GENERIC` where the config has the field, then `OVERRIDES`."""
    fields = _config_fields(CONFIG_MAPPING[model_type])
    kwargs = {key: value for key, value in GENERIC.items() if key in fields}
    kwargs.update(OVERRIDES.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **kwargs)
    config.use_cache = True
    return config


@functools.cache
def tiny_model(model_type: str, dtype: torch.dtype = torch.float32):
    """The tiny random model of ``model_type`` (seed 0, eval mode, ``dtype``), built once per process."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    return model


def layer_types(config: PretrainedConfig) -> list[str]:
    """The cache layer type of every layer, as transformers' caches read them (``dummy`` for KV-sharing layers and
    attention-free ones)."""
    return list(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])


def layer_kinds(model_type: str) -> str:
    """The distinct layer types of ``model_type``'s tiny config, e.g. ``"full_attention+sliding_attention"``."""
    return "+".join(sorted(set(layer_types(tiny_config(model_type)))))


# ---------------------------------------------------------------------------------------------------- re-measuring

def measure(model_type: str, *, prompt: int = 48, new: int = 6) -> tuple[str, str]:
    """(``"ok"`` | a failure class, detail) for one architecture: builds the tiny model, generates greedily with
    `DynamicCache` from a left-padded batch of 2 and compares every step's logits with recomputing the whole
    sequence without a cache (close, not bit-equal: another kernel order)."""
    from transformers import DynamicCache

    start = time.perf_counter()
    try:
        model = tiny_model(model_type)
    except Exception as err:
        return "build fails", _first_line(err)
    built = time.perf_counter() - start
    if built > 20:
        return "builds too slowly", f"{built:.0f} s"
    ids = torch.randint(3, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = PAD
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            full = out.sequences
            full_mask = torch.cat([mask, torch.ones(2, full.shape[1] - prompt, dtype=mask.dtype)], dim=1)
            recomputed = model(full, attention_mask=full_mask, use_cache=False).logits
    except Exception as err:
        return "DynamicCache fails", _first_line(err)
    for step, logits in enumerate(out.logits):  # row 0 (unpadded: absolute positions need no position ids)
        want = recomputed[0, prompt - 1 + step].float()
        diff = (logits[0].float() - want).abs().max().item()
        if not diff < 1e-2 * max(1.0, want.abs().max().item()):
            return "DynamicCache differs from recomputing", f"step {step}: max logit diff {diff:.3g}"
    return "ok", f"{time.perf_counter() - start:.1f} s, {layer_kinds(model_type)}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


if __name__ == "__main__":
    import sys
    import warnings

    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    names = sys.argv[1:] or decoder_architectures()
    if not sys.argv[1:]:
        for name, reason in not_decoder_only().items():
            print(f"not decoder-only  {name}: {reason}")
    import signal

    def _alarm(*_):
        raise TimeoutError("over 60 s")

    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        signal.alarm(60)
        try:
            status, detail = measure(name)
        except TimeoutError as err:
            status, detail = "builds too slowly", str(err)
        finally:
            signal.alarm(0)
        skipped = f"  [SKIPPED: {SKIPPED[name]}]" if name in SKIPPED else ""
        print(f"{status:<18} {name}: {detail}{skipped}", flush=True)
