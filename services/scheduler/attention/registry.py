"""Which attention backend runs: names to class paths, imported only when chosen.

The backends subclass `base.AttentionBackend`; neither they nor the base know this module, so
a new backend is one file and one line here.
"""

from __future__ import annotations

import importlib

import torch

from services.scheduler.attention.base import AttentionBackend

BACKENDS = {
    "torch": "services.scheduler.attention.torch_backend:TorchBackend",
    "triton": "services.scheduler.attention.triton_backend:TritonBackend",
}


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        choices = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown attention backend {name!r} (choose {choices})")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
