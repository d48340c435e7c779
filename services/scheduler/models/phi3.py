"""Phi-3: Llama whose checkpoints ship q/k/v and gate/up fused already (our own layout, so
they load as they are), with every layer inside a sliding window when the config sets one."""

from __future__ import annotations

from services.scheduler.models.layers import Arch, CausalLM


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: dict) -> Arch:
        window = config.get("sliding_window")
        return Arch(windows=(window,) * config["num_hidden_layers"])
