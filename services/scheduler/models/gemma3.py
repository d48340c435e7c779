"""Gemma 3 (text): what it changes in the shared decoder.

- embeddings scaled by sqrt(hidden); RMSNorm scales by (1 + weight), in float32;
- GeGLU (tanh-approximated GELU on the gate);
- q and k RMS-normed per head; softmax scale query_pre_attn_scalar ** -0.5;
- norms before and after both attention and MLP (the layer below);
- local layers (a sliding window, rope base 10k) interleaved with global ones (rope base 1M).
"""

from __future__ import annotations

from torch import nn

from services.scheduler.models.layers import (
    MLP,
    Arch,
    Attention,
    CausalLM,
    RMSNorm,
    add_rms_norm_,
    rope_parameters,
    windows_from_layer_types,
)

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: dict) -> list[str]:
    if config.get("layer_types"):
        return list(config["layer_types"])
    # older configs: every `sliding_window_pattern`-th layer is global
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern", 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config["num_hidden_layers"])]


def layer_rope(config: dict, kind: str) -> dict:
    rope = rope_parameters(config, kind)
    if kind == SLIDING and not isinstance((config.get("rope_parameters") or {}).get(SLIDING),
                                          dict):
        # older configs: local layers take `rope_local_base_freq`, and no scaling
        rope = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 1e4)}
    return rope


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict, arch: Arch, window, rotary, backend) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, 1.0)
        self.self_attn = Attention(config, arch, window, rotary, backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, 1.0)
        self.mlp = MLP(config, arch)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, 1.0)

    def forward(self, x, residual, rope, meta, k_cache, v_cache):
        """(x, residual) in and out, as layers.DecoderLayer; x here is the normed MLP output."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = add_rms_norm_(residual, x, self.input_layernorm)
        attn = self.self_attn(h, rope, meta, k_cache, v_cache)
        h = add_rms_norm_(residual, self.post_attention_layernorm(attn, inplace=True),
                          self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(self.mlp(h), inplace=True), residual


class Gemma3ForCausalLM(CausalLM):
    layer_class = Gemma3DecoderLayer

    @classmethod
    def arch(cls, config: dict) -> Arch:
        kinds = layer_types(config)
        windows = windows_from_layer_types({**config, "layer_types": kinds})
        return Arch(
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            qk_norm=True,
            norm_offset=1.0,
            activation=config.get("hidden_activation") or "gelu_pytorch_tanh",
            embed_scale=config["hidden_size"] ** 0.5,
            attn_scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
            windows=windows,
            ropes=tuple(layer_rope(config, k) for k in kinds),
        )
