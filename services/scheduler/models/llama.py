"""Llama (and SmolLM2): the shared decoder as it is, `layers.Arch`'s defaults."""

from __future__ import annotations

from services.scheduler.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
