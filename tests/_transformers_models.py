"""Tiny random-weight Transformers models and inputs shared by the safeattn.transformers tests.

Every model is built from a config (no download): hidden size 64, 2 layers, vocabulary 100,
4 query heads over 2 key/value heads (grouped-query attention), head dim 16.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging import version

TF_VERSION = version.parse(transformers.__version__)
IS_TF4 = TF_VERSION.major < 5

VOCAB = 100
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
HYBRID = ["sliding_attention", "full_attention"]

# name: (config class, config overrides, reference attention). The reference is "eager" where
# "sdpa" ignores a feature the model has (Gemma2's softcap, GPT-OSS's sinks). Gemma2 and GPT-OSS
# use larger weights so that the softcap and the sinks change the logits well above tolerance.
MODELS = {
    "llama": ("LlamaConfig", {}, "sdpa"),
    "mistral": ("MistralConfig", {"sliding_window": 4}, "sdpa"),
    "qwen3": (
        "Qwen3Config",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2, "layer_types": HYBRID},
        "sdpa",
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 4,
            "attn_logit_softcapping": 1.0,
            "query_pre_attn_scalar": 16,
            "layer_types": HYBRID,
            "initializer_range": 0.2,
        },
        "eager",
    ),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 4, "layer_types": HYBRID}, "sdpa"),
    "llama4": (
        "Llama4TextConfig",
        {"attention_chunk_size": 4, "moe_layers": [], "no_rope_layers": [1, 0], "intermediate_size_mlp": 128},
        "sdpa",
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "intermediate_size": 64,
            "sliding_window": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": HYBRID,
            "initializer_range": 0.2,
        },
        "eager",
    ),
}


def make_config(name: str):
    class_name, overrides, _ = MODELS[name]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"{class_name} is not in transformers {transformers.__version__}")
    return config_class(**{**COMMON, **overrides})


def reference_impl(name: str) -> str:
    return MODELS[name][2]


def make_model(config, attn_implementation: str, dtype=torch.float32, seed: int = 0):
    """The same random weights for every attention implementation (same seed, same config)."""
    torch.manual_seed(seed)
    # from_config writes the implementation into the config it is given: work on a copy.
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attn_implementation
    )
    return model.to(dtype).eval()


def padded_batch(side: str, seed: int = 0):
    """input_ids [3, 10] with padding on `side` ("left" or "right"): 4, 0 and 1 pad tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    for row, pads in enumerate((4, 0, 1)):
        if pads:
            if side == "left":
                attention_mask[row, :pads] = 0
            else:
                attention_mask[row, -pads:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, COMMON["pad_token_id"])
    return input_ids, attention_mask


def packed_batch(seed: int = 0):
    """input_ids [2, 10] and position_ids holding 3 and 2 packed sequences (no attention mask)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (2, 10), generator=g)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    return input_ids, position_ids
