"""The fused small ops (ops_cpu.cpp) for the tensors they take, resolved once per process.

The decoder's layers and the sampler ask `fused_ops(x)`; None means plain torch runs (CUDA, a
dtype the kernels do not take, TOKENLINE_CPU_KERNELS=0, no compiler).
"""

from __future__ import annotations

import torch

from services.scheduler.native import OPS

FUSED_DTYPES = (torch.float32, torch.bfloat16)
_UNRESOLVED = object()
_ops_module: object = _UNRESOLVED  # the built module (or None), once asked for


def fused_ops(x: torch.Tensor):
    """The C++ ops for tensors like `x`, or None where plain torch runs."""
    global _ops_module
    if not x.is_cpu or x.dtype not in FUSED_DTYPES:
        return None
    if _ops_module is _UNRESOLVED:
        _ops_module = OPS.module()  # raises under TOKENLINE_CPU_KERNELS=require if it failed
    return _ops_module
