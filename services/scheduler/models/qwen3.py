"""Qwen3: Llama with an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

from services.scheduler.models.layers import Arch, CausalLM
from services.scheduler.models.qwen2 import qwen_windows


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: dict) -> Arch:
        bias = bool(config.get("attention_bias", False))
        return Arch(qkv_bias=bias, o_bias=bias, qk_norm=True, windows=qwen_windows(config))
