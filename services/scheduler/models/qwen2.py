"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (not on o).

Their configs carry a `sliding_window` that applies only with `use_sliding_window`, and then
only to layers from `max_window_layers` on (transformers writes that out as `layer_types`).
"""

from __future__ import annotations

from services.scheduler.models.layers import Arch, CausalLM, windows_from_layer_types


def qwen_windows(config: dict) -> tuple[int | None, ...]:
    n = config["num_hidden_layers"]
    if not config.get("use_sliding_window") or not config.get("sliding_window"):
        return (None,) * n
    if config.get("layer_types"):
        return windows_from_layer_types(config)
    first = config.get("max_window_layers", n)
    return tuple(config["sliding_window"] if i >= first else None for i in range(n))


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def arch(cls, config: dict) -> Arch:
        return Arch(qkv_bias=True, windows=qwen_windows(config))
