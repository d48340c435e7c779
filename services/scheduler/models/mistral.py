"""Mistral: Llama with every layer inside a sliding window when the config sets one."""

from __future__ import annotations

from services.scheduler.models.layers import Arch, CausalLM


class MistralForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: dict) -> Arch:
        window = config.get("sliding_window")
        return Arch(windows=(window,) * config["num_hidden_layers"])
