"""Weight-only quantized linears: int8 and int4 in groups of 32 along K, run by our C++ kernels.

Each format has a plain form (codes and scales as ordinary tensors: the dequantize-then-matmul
reference, and what GGUF blocks are read into) and a packed form that a kernel runs:

    w[n, k] = scale[n, g] * c[n, k] + minimum[n, g]     g = k // 32, c in [0, 255] (int8)
                                                        or [0, 15] (int4)

Both map onto GGUF's blocks exactly, with no requantization (verified: tests/unit/test_quant.py
checks each against gguf-py's own dequantization):

- Q8_0 is d * q per 32 values, q in [-127, 127]: scale = d, minimum = -128 d, c = q + 128;
- Q4_0 is d * (c - 8): scale = d, minimum = -8 d;
- Q4_1 is d * c + m: scale = d, minimum = m;
- Q4_K's super-blocks of 256 are 8 sub-blocks of 32, each (d * sc) * c - (dmin * m) with 6-bit
  sc and m: scale = d * sc, minimum = -dmin * m, exact per-32 float32 values (11 + 6 bits).

Q8_0, Q4_0 and Q4_1 scales are float16 in the file and stay float16 here; Q4_K's d * sc need up
to 17 bits, so those layers keep float32 scales (`_scale_dtype` picks, per layer, the narrowest
dtype that holds them exactly).
Other types and float weights are quantized at load: each group's min and max map to the
lowest and highest code (float16 scale and minimum). int8 from a Q4_1 file is such a
requantization: a group of Q4_1 values whose codes span 0..15 lands exactly on the int8 grid
(255 = 17 x 15), any other within half an int8 step.

The packed forms are 16 output channels interleaved per k (quant_cpu.cpp), and the kernels take
and return float32 with float32 sums: they differ from the reference by summation order only.
bfloat16 activations are accepted (converted around the call). Where the C++ kernels cannot be
built (no compiler), torch's own CPU kernels run instead (`torch._weight_int8pack_mm`, per-row
int8 requantized from our groups, and `torch._weight_int4pack_mm_for_cpu`), with bfloat16
activations: those are the only ones torch vectorizes (float32 ones measured 28-200x slower).

On CUDA the quantized weights are dequantized once at load to the model dtype (see
`ModelRunner`): --quantization then saves nothing on the GPU but never fails there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.logging import get_logger
from services.scheduler.native import QUANT, cpu_flags

log = get_logger("quant")


# torch's CPU int8 and int4 kernels (the fallback) are vectorized for bfloat16 activations only
TORCH_KERNEL_DTYPE = torch.bfloat16
GROUP = 32  # values per scale: GGUF Q8_0's, Q4_0/Q4_1's block and Q4_K's sub-block
LANES = 16  # output channels per tile of the C++ kernels
_INT4_N_ALIGN = 16  # torch's CPU int4 packing wants N divisible by 16
# torch's bfloat16 int8 kernel reads past the row (garbage out, or a crash) when K is not a
# multiple of 16 (torch 2.13, seen with K = 8, 24, 100): rows are padded with zeros to 32
_INT8_K_ALIGN = 32
_F16_TINY = 2.0**-24  # float16's smallest positive value: a scale never rounds to zero
_F16_MAX = 65504.0


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def native() -> bool:
    """Whether the C++ kernels run here (else torch's; raises under TOKENLINE_CPU_KERNELS=require
    when they should have built and did not)."""
    return QUANT.module() is not None


def kernel_dtype() -> torch.dtype:
    """The activation dtype the quantized matmuls compute in on CPU."""
    return torch.float32 if native() else TORCH_KERNEL_DTYPE


def _to_f16_grid(scale: torch.Tensor) -> torch.Tensor:
    """Scales rounded to float16 (held as float32), never zero: codes are computed against the
    scale the kernel will use."""
    return scale.clamp(_F16_TINY, _F16_MAX).half().float()


def _scale_dtype(*scales: torch.Tensor) -> torch.dtype:
    """float16 where every value survives the round trip (Q8_0, Q4_0, Q4_1, at-load), else
    float32 (Q4_K's d * sc)."""
    exact = all(torch.equal(s.half().float(), s) for s in scales)
    return torch.float16 if exact else torch.float32


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [ceil(N/16), X, 16]: 16 output channels interleaved per column, N padded."""
    n = t.shape[0]
    t = F.pad(t, (0, 0, 0, _round_up(n, LANES) - n))
    return t.view(-1, LANES, t.shape[1]).transpose(1, 2).contiguous()


def _native_matmul(fn, x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int,
                   k: int) -> torch.Tensor:
    """x [..., k] (float32 or bfloat16) through a C++ kernel; the result in x's dtype."""
    kp = scales.shape[1] * GROUP
    if x.numel() == 0:  # no rows (a step without logits): the kernels assume at least one
        return x.new_zeros(*x.shape[:-1], n)
    if x.dim() == 2 and kp == k and x.dtype == torch.float32 and x.is_contiguous():
        return fn(x, tiles, scales, n)  # a decoder's own case: no reshape, pad or view to run
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if kp != k:
        x2 = F.pad(x2, (0, kp - k))
    out = fn(x2.contiguous(), tiles, scales, n)
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


@dataclass
class _GroupPlain:
    """codes [N, Kp] uint8, scale and minimum [N, Kp/32] float32 (Kp = K padded with zeros to
    a whole group): w[n, k] = scale[n, k // 32] * codes[n, k] + minimum[n, k // 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    in_features: int  # K before padding to a whole group

    LEVELS = 0  # the largest code

    @classmethod
    def quantize(cls, weight: torch.Tensor):
        """Asymmetric per group of 32 (as GGUF's Q4_1): the group's min and max map to 0 and
        the largest code, with the scale and minimum rounded to float16 first (the codes are
        for the numbers the kernel will use)."""
        n, k = weight.shape
        w = F.pad(weight.detach().float(), (0, _round_up(k, GROUP) - k)).view(n, -1, GROUP)
        lo = w.amin(dim=2).clamp(-_F16_MAX, _F16_MAX).half().float()
        scale = _to_f16_grid((w.amax(dim=2) - lo) / cls.LEVELS)
        codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, cls.LEVELS)
        return cls(codes.to(torch.uint8).view(n, -1), scale, lo, k)

    def dequantize(self) -> torch.Tensor:
        n = self.codes.shape[0]
        w = self.codes.view(n, -1, GROUP).float() * self.scale[..., None] + self.minimum[..., None]
        return w.view(n, -1)[:, : self.in_features]

    def select(self, rows: torch.Tensor | slice):
        return type(self)(self.codes[rows], self.scale[rows], self.minimum[rows],
                          self.in_features)

    @classmethod
    def cat(cls, parts: list):
        return cls(*(torch.cat([getattr(p, f) for p in parts])
                     for f in ("codes", "scale", "minimum")), parts[0].in_features)

    def _scale_min(self) -> torch.Tensor:
        """[T, Kp/32, 2, 16]: each group's 16 scales, then its 16 minimums."""
        dtype = _scale_dtype(self.scale, self.minimum)
        return torch.stack([_tiles(self.scale), _tiles(self.minimum)], dim=2).to(dtype)


class Int8Plain(_GroupPlain):
    """Codes 0..255. Against symmetric int8 (Q8_0's d * q), the group's range [min, max] gets
    all 256 levels rather than [-max|w|, max|w|] 255: at least as fine, and a Q8_0 block is one
    such group as it is (scale d, minimum -128 d, codes q + 128)."""

    LEVELS = 255

    def pack(self) -> Int8Linear | TorchInt8Linear:
        """For our kernel where it builds, else for torch's (per-row int8, bfloat16 in)."""
        if native():
            return Int8Linear(_tiles(self.codes), self._scale_min().contiguous(),
                              self.codes.shape[0], self.in_features)
        return TorchInt8Linear.quantize(self.dequantize())


class Int4Plain(_GroupPlain):
    """Codes 0..15: GGUF Q4_0, Q4_1 and Q4_K map onto it as they are."""

    LEVELS = 15

    def pack(self) -> Int4Linear | TorchInt4Linear:
        """For our kernel where it builds, else for torch's (bfloat16 in)."""
        if not native():
            return TorchInt4Linear.from_plain(self)
        n, kp = self.codes.shape
        pairs = self.codes.view(n, kp // 2, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)  # k = 2j low nibble, 2j + 1 high
        return Int4Linear(_tiles(packed), self._scale_min().contiguous(), n, self.in_features)


class Int8Linear:
    """x @ w.T for an int8 group-32 weight, through our C++ kernel (float32 in and out)."""

    def __init__(self, tiles: torch.Tensor, scale_min: torch.Tensor, out_features: int,
                 in_features: int) -> None:
        self.tiles = tiles  # [T, Kp, 16] uint8
        self.scale_min = scale_min  # [T, Kp/32, 2, 16] float16 or float32
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Linear | TorchInt8Linear:
        return Int8Plain.quantize(weight).pack()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _native_matmul(QUANT.module().int8_linear, x, self.tiles, self.scale_min,
                              self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (a tied embedding's lookups)."""
        tile, lane = ids // LANES, ids % LANES
        codes = self.tiles[tile, :, lane].view(len(ids), -1, GROUP).float()
        sm = self.scale_min[tile, :, :, lane].float()  # [len(ids), Kp/32, 2]
        w = codes * sm[..., 0:1] + sm[..., 1:2]
        return w.view(len(ids), -1)[:, : self.in_features].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + self.scale_min.nbytes


class Int4Linear:
    """x @ w.T for an int4 group-32 weight with scale and minimum, through our C++ kernel."""

    def __init__(self, tiles: torch.Tensor, scale_min: torch.Tensor, out_features: int,
                 in_features: int) -> None:
        self.tiles = tiles  # [T, Kp/2, 16] uint8, two codes a byte
        self.scale_min = scale_min  # [T, Kp/32, 2, 16] float16 or float32
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Linear | TorchInt4Linear:
        return Int4Plain.quantize(weight).pack()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _native_matmul(QUANT.module().int4_linear, x, self.tiles, self.scale_min,
                              self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + self.scale_min.nbytes


def _rows(x: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """x [..., k] as 2-D rows in `dtype` with unit stride along k (rows at any stride): what
    the tile kernels take."""
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _unrows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A tile kernel's [M, N] back to x's leading shape and dtype."""
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], out.shape[-1])
    return out if out.dtype == x.dtype else out.to(x.dtype)


class Float32Tiles:
    """x @ w.T (+ bias) for a float32 weight in the same tiles ([T, K, 16]), through our C++
    kernel: the float32 projections on AVX-512 and AVX2 CPUs (`float32_tiles_missing`).

    Why not oneDNN, which ran them before: at a decode step's 1-64 rows its packed float32
    kernel is far from either bound, while these tiles run the int8 kernel's register blocks
    (three tiles by 8 rows, each broadcast activation feeding three FMAs) straight from the
    weights, the next group of tiles prefetched while one runs. A SmolLM2 decode step's
    matmuls, every layer its own weight (`python -m bench.quant_kernels --from-memory`, a
    2-core Zen 4 EPYC): 1 row 18.3 against 36.0 ms, 4 rows 21.0 / 32.1, 16 rows 27.7 / 38.3, 44
    rows 66.3 / 85.5, 64 rows 88.9 / 95.1; at a prefill's 2,048 rows within a few per cent
    either way (`--batches 2048`: the 30 layers' projections 2,237 against 2,370 ms per shape in
    cache, the whole step's from DRAM 2,855 against 2,769). On an AVX2 EPYC (Zen 3, 2 cores;
    the AVX2 register blocks, 6 rows by one tile; b36c679, before the k blocks and the 5-row
    block: docs/benchmarks.md, "Matmul kernels", has the later run) from DRAM: 1 row 18.5
    against 28.2 ms, 8 rows 28.3 / 42.4, 64 rows 124.2 / 132.8; in cache 16 rows 29.8 / 44.6,
    512 rows 889 / 872, 2,048 rows 3,830 / 4,077. Same bytes as oneDNN's copy; the sums are
    float32 in another order (results agree to ~1e-6 relative)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.tiles = _tiles(weight.detach().float())  # [T, K, 16]
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (float32; another dtype goes through float32) -> [..., N] in x's dtype."""
        out = QUANT.module().float_linear(_rows(x, self.in_features, torch.float32), self.tiles,
                                          self.bias, self.out_features)
        return _unrows(out, x)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + (0 if self.bias is None else self.bias.nbytes)


def float32_tiles_missing(in_features: list[int]) -> str | None:
    """Why float32 projections of these input widths would not run from Float32Tiles here
    (None: they do). They need the C++ kernels built with AVX-512 or with AVX2 and FMA (the
    portable loops are far slower than oneDNN) and widths that are multiples of 4;
    TOKENLINE_FLOAT32_TILES=0 keeps oneDNN (1, the default, asks for the tiles; anything else
    is an error). A CPU with neither is told from its flags, without building the kernels."""
    setting = os.environ.get("TOKENLINE_FLOAT32_TILES", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"TOKENLINE_FLOAT32_TILES must be 0 or 1, not {setting!r}")
    if setting == "0":
        return "TOKENLINE_FLOAT32_TILES=0"
    flags = cpu_flags()
    if flags and "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    module = QUANT.module()
    if module is None:
        return "no C++ matmul kernels"
    if module.float_isa() == "portable":
        return "the C++ matmul kernels were built without AVX-512 or AVX2"
    odd = sorted({k for k in in_features if k % 4})
    if odd:
        return f"input widths {odd} are not multiples of 4"
    return None


# bfloat16 calls of up to this many rows run from our tiles, larger ones from oneDNN's copy
# (on AMX, compute-bound much sooner than VDPBF16PS, which issues at half the FMAs' rate on the
# Xeon). A SmolLM2 step's matmuls from DRAM (`bench.quant_kernels --from-memory`, the AMX Xeon
# VM): tiles against oneDNN 15.3 / 27.2 ms at 1 row, 19.0 / 26.0 at 4, 22.6 / 28.0 at 8, 30.6 /
# 26.0 at 16, 98 / 36 at 64. The lm_head (49,152 x 576) turns sooner: 1.24 / 1.27 ms at 4
# rows, 2.29 / 1.29 at 8 (in cache).
BF16_TILE_ROWS = 12
BF16_LM_HEAD_ROWS = 4


class Bf16Tiles:
    """x @ w.T (+ bias) for a bfloat16 weight in tiles of 16 channels with k in pairs ([T, K/2,
    16, 2]), through our C++ kernel (VDPBF16PS, AVX512-BF16): the bfloat16 projections of up
    to `rows` rows; from there oneDNN's copy (`onednn`), which on AMX multiplies a prefill's
    rows several times faster. Why ours below: oneDNN's bfloat16 inner product costs ~0.1 ms a
    call at 1-4 rows whatever the shape (the AMX Xeon VM: a batch-1 step's 121 projections in
    14 ms from cache, against the 9 ms its float32 tiles take for twice the bytes), and ours
    reads the bfloat16 weights at the float32 tiles' pace. Float32 sums, the bias (float32)
    added before the one rounding to bfloat16, as oneDNN does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 onednn: torch.Tensor | None = None, rows: int = 0) -> None:
        self.out_features, self.in_features = weight.shape
        t = _tiles(weight.detach().to(torch.bfloat16))  # [T, K, 16]
        self.tiles = t.view(t.shape[0], -1, 2, LANES).transpose(2, 3).contiguous()  # [T,K/2,16,2]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.onednn, self.rows = onednn, rows
        self.onednn_bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (bfloat16; another dtype goes through bfloat16) -> [..., N] in x's dtype."""
        x2 = _rows(x, self.in_features, torch.bfloat16)
        if self.onednn is not None and x2.shape[0] > self.rows:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.onednn, self.onednn_bias, "none",
                                                     [], "")
        else:
            out = QUANT.module().bf16_linear(x2, self.tiles, self.bias, self.out_features)
        return _unrows(out, x)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.onednn is None else self.onednn.numel() * self.onednn.element_size()
        return self.tiles.nbytes + extra + (0 if self.bias is None else self.bias.nbytes)


def bf16_tiles_missing(in_features: list[int]) -> str | None:
    """Why bfloat16 projections of these input widths would not run from Bf16Tiles here (None:
    they do, below its `rows`). They need the C++ kernels built with AVX512-BF16 and widths
    that are multiples of 8; TOKENLINE_BF16_TILES=0 keeps oneDNN for every call (1, the
    default, asks for the tiles; anything else is an error)."""
    setting = os.environ.get("TOKENLINE_BF16_TILES", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"TOKENLINE_BF16_TILES must be 0 or 1, not {setting!r}")
    if setting == "0":
        return "TOKENLINE_BF16_TILES=0"
    flags = cpu_flags()
    if flags and "avx512_bf16" not in flags:
        return "this CPU has no AVX512-BF16"
    module = QUANT.module()
    if module is None:
        return "no C++ matmul kernels"
    if not module.bf16_tiles_built():
        return "the C++ matmul kernels were built without AVX512-BF16"
    odd = sorted({k for k in in_features if k % 8})
    if odd:
        return f"input widths {odd} are not multiples of 8"
    return None


# -- torch's own CPU kernels: the fallback where ours cannot be built ---------------------------

class TorchInt8Linear:
    """x @ w.T for an int8 weight with per-row scales, through torch's CPU int8 kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, in_features: int) -> None:
        self.q = q
        self.scale = scale
        self.in_features = in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor,
                 dtype: torch.dtype = TORCH_KERNEL_DTYPE) -> TorchInt8Linear:
        """Symmetric, per output row: the row's largest |w| maps to 127."""
        n, k = weight.shape
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        q = F.pad(q, (0, _round_up(k, _INT8_K_ALIGN) - k)).contiguous()
        return cls(q, scale.to(dtype), k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xin = x if x.dtype == self.scale.dtype else x.to(self.scale.dtype)
        if self.q.shape[1] != self.in_features:
            xin = F.pad(xin, (0, self.q.shape[1] - self.in_features))
        return torch._weight_int8pack_mm(xin, self.q, self.scale).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.q.index_select(0, ids)[:, : self.in_features]
        return q.to(dtype) * self.scale.index_select(0, ids)[:, None].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class TorchInt4Linear:
    """x @ w.T for an int4 group-32 weight, through torch's CPU int4 kernel, which computes
    (c - 8) * scale + zero: so zero = minimum + 8 * scale."""

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 in_features: int, padded_in: int) -> None:
        self.packed = packed
        self.scale_zeros = scale_zeros
        self.out_features = out_features
        self.in_features = in_features
        self.padded_in = padded_in

    @classmethod
    def from_plain(cls, plain: Int4Plain,
                   dtype: torch.dtype = TORCH_KERNEL_DTYPE) -> TorchInt4Linear:
        n, kp = plain.codes.shape
        pad = _round_up(n, _INT4_N_ALIGN) - n
        codes = F.pad(plain.codes.to(torch.int32), (0, 0, 0, pad))
        scale = F.pad(plain.scale, (0, 0, 0, pad))
        zero = F.pad(plain.minimum, (0, 0, 0, pad)) + 8 * scale
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale_zeros = torch.stack([scale.t(), zero.t()], dim=2).to(dtype).contiguous()
        return cls(packed, scale_zeros, n, plain.in_features, kp)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xin = x if x.dtype == self.scale_zeros.dtype else x.to(self.scale_zeros.dtype)
        if self.padded_in != self.in_features:
            xin = F.pad(xin, (0, self.padded_in - self.in_features))
        out = torch._weight_int4pack_mm_for_cpu(xin, self.packed, GROUP, self.scale_zeros)
        if out.shape[-1] != self.out_features:
            out = out[..., : self.out_features]
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes


# -- GGUF blocks into the plain forms -----------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _q4_block(b: torch.Tensor, has_min: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """Blocks [N, nb, 18 | 20] of Q4_0 (d f16) or Q4_1 (d f16, m f16), then 16 bytes of
    nibbles (low: values 0-15, high: 16-31). Q4_0 is d * (c - 8): minimum -8 d."""
    d = _f16(b[..., 0:2])
    qs = b[..., 4:20] if has_min else b[..., 2:18]
    minimum = _f16(b[..., 2:4]) if has_min else -8 * d
    return torch.cat([qs & 15, qs >> 4], dim=-1), d, minimum


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks [N, nb, 144] of 8 sub-blocks of 32: d, dmin f16, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes of nibbles (64 values per 32 bytes: low, then high)."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    q = b[..., 4:16].int()
    lo, hi = q[..., 0:4], q[..., 4:8]  # ggml's get_scale_min_k4
    sc = torch.cat([lo & 63, (q[..., 8:12] & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (q[..., 8:12] >> 4) | ((hi >> 6) << 4)], dim=-1)
    qs = b[..., 16:144].view(*b.shape[:-1], 4, 32)
    codes = torch.stack([qs & 15, qs >> 4], dim=-2)  # [N, nb, 4, 2, 32]: sub-block 2i, 2i+1
    # d * sc and dmin * m are exact in float32 (11 + 6 bits): per-32 floats, no rounding
    return codes.reshape(*b.shape[:-1], 8, 32), d * sc.float(), -dmin * mn.float()


# GGUF type -> (values per block, bytes per block, decoder to codes, scale, minimum)
_INT4_TYPES = {"Q4_0": (32, 18, partial(_q4_block, has_min=False)),
               "Q4_1": (32, 20, partial(_q4_block, has_min=True)),
               "Q4_K": (256, 144, _q4_k)}
_INT8_TYPES = ("Q8_0",)


def int4_from_gguf(type_name: str, raw: torch.Tensor, in_features: int) -> Int4Plain:
    """A GGUF tensor's rows [N, bytes per row] (uint8) of type Q4_0, Q4_1 or Q4_K, as they are."""
    per_block, nbytes, decode = _INT4_TYPES[type_name]
    n = raw.shape[0]
    codes, scale, minimum = decode(raw.reshape(n, -1, nbytes))
    return Int4Plain(codes.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1),
                     in_features)


def int8_from_gguf(raw: torch.Tensor, in_features: int) -> Int8Plain:
    """A Q8_0 tensor's rows [N, bytes per row] (uint8), as they are: blocks of 34 bytes, d f16
    then 32 int8 values q, w = d * q = d * (q + 128) - 128 d."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 34)
    q = b[..., 2:34].contiguous().view(torch.int8).to(torch.int16)
    d = _f16(b[..., 0:2])
    return Int8Plain((q + 128).to(torch.uint8).reshape(n, -1), d.reshape(n, -1),
                     (-128 * d).reshape(n, -1), in_features)


Plain = Int8Plain | Int4Plain


class GGUFWeights:
    """A GGUF file's own int8 (Q8_0) and 4-bit blocks, by the HF name of the layer, rows in
    transformers' order (llama.cpp stores a Llama's q and k rows permuted for its rotary
    layout)."""

    # our fused projections, made of the HF layers they concatenate along the output rows
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, path: Path, config: dict) -> None:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        self.arch = bytes(field.parts[field.data[0]]).decode()
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(self.arch)
        self.names = None if arch is None else gguf.get_tensor_name_map(
            arch, config["num_hidden_layers"])
        self.tensors = {t.name: t for t in reader.tensors}
        self.types = sorted({t.tensor_type.name for t in reader.tensors})
        self.config = config

    # GGUF types whose values are floats: any --quantization quantizes them at load
    FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

    def check(self, mode: str) -> None:
        """Refuse int4 from a file whose layers are quantized in a type other than Q4_0, Q4_1
        or Q4_K: rounding values already rounded otherwise a second time, to 4 bits, is not
        what a user asking for int4 expects (int8 runs any type: its grid is finer)."""
        if mode != "int4":
            return
        # the embedding (token_embd, the tied lm_head) runs int8 under int4 anyway
        others = {t.tensor_type.name for t in self.tensors.values()
                  if t.name.startswith("blk.") and t.name.endswith(".weight")
                  and t.tensor_type.name not in (*_INT4_TYPES, *self.FLOAT_TYPES)}
        if others:
            raise ValueError(
                f"--quantization int4: this GGUF's layers are {', '.join(sorted(others))}, "
                "which int4 cannot run as they are (it runs Q4_0, Q4_1, Q4_K or float "
                "weights); use --quantization int8 or none")

    def plain(self, module_name: str, mode: str) -> Plain | None:
        """Our layer `module_name` (e.g. layers.3.mlp.gate_up_proj, or lm_head / embed_tokens)
        from the file's blocks of `mode`'s kind, or None where the file does not hold all its
        parts in a type that maps exactly."""
        head, _, leaf = module_name.rpartition(".")
        prefix = f"model.{head}." if head else ("" if leaf == "lm_head" else "model.")
        parts = [self._one(f"{prefix}{p}", mode) for p in self.FUSED.get(leaf, (leaf,))]
        if any(p is None for p in parts):
            return None
        return type(parts[0]).cat(parts)

    def int4(self, module_name: str) -> Int4Plain | None:
        return self.plain(module_name, "int4")

    def _one(self, hf_name: str, mode: str) -> Plain | None:
        name = self.names and self.names.get_name(hf_name)
        t = self.tensors.get(f"{name}.weight")
        kind = t and t.tensor_type.name
        if t is None or kind not in (_INT4_TYPES if mode == "int4" else _INT8_TYPES):
            return None
        raw, k = torch.from_numpy(np.array(t.data)), int(t.shape[0])
        plain = int4_from_gguf(kind, raw, k) if mode == "int4" else int8_from_gguf(raw, k)
        leaf = hf_name.rpartition(".")[2]
        if self.arch == "llama" and leaf in ("q_proj", "k_proj"):
            c = self.config
            heads = c["num_attention_heads"] if leaf == "q_proj" else c.get(
                "num_key_value_heads", c["num_attention_heads"])
            n = raw.shape[0]
            # transformers' reverse_permute_weights, as a row order
            rows = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
            plain = plain.select(rows)
        return plain


MODES = ("none", "int8", "int4")
QuantizedWeight = Int8Linear | Int4Linear | TorchInt8Linear | TorchInt4Linear


@dataclass
class QuantSummary:
    """What `quantize_model` did, for the start-up log and /get_server_info."""

    mode: str
    kernel: str = "native"  # "native" (ours, float32), "torch" (bfloat16) or "dequantized"
    from_file: int = 0  # layers whose codes came from the GGUF as they are
    at_load: int = 0  # layers quantized at load from their float weights
    small_calls: str = ""  # calibrate_small_calls: the threads a 1-3 row call runs on, and why

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "kernel": self.kernel, "layers_from_file": self.from_file,
               "layers_quantized_at_load": self.at_load}
        if self.small_calls:
            out["small_calls"] = self.small_calls
        return out


def calibrate_small_calls(layers: list, rounds: int = 3) -> str:
    """Time a batch-1 pass over `layers` (the model's quantized matmuls, each its own weight, so
    read from memory as in a decode step) with 1-3 row calls on the calling thread and on every
    thread, alternating `rounds` times, and keep the faster. Which wins is the machine's: one
    core streamed nearly both cores' bandwidth on one CPU here (one thread won by a quarter)
    and two thirds of it on another (two threads won by a third). TOKENLINE_QUANT_SMALL_CALLS
    = one|all skips the measurement. Returns what was chosen, for the start-up log."""
    module = QUANT.module()
    forced = os.environ.get("TOKENLINE_QUANT_SMALL_CALLS", "auto")
    if forced not in ("auto", "one", "all"):
        raise ValueError(f"TOKENLINE_QUANT_SMALL_CALLS must be auto, one or all, not {forced!r}")
    limits = {"one": module.one_thread_bytes_default(), "all": 0}
    layers = [q for q in layers if isinstance(q, (Int8Linear, Int4Linear))]
    if forced != "auto" or torch.get_num_threads() == 1 or not layers:
        choice = "all" if forced == "all" else "one"
        module.set_one_thread_bytes(limits[choice])
        why = ("TOKENLINE_QUANT_SMALL_CALLS" if forced != "auto" else
               "torch runs one thread" if layers else "no native layers")
        return f"{choice} thread{'s' if choice == 'all' else ''} ({why})"
    inputs = {}
    for q in layers:
        inputs.setdefault(q.in_features, torch.randn(1, q.in_features))

    def one_pass() -> float:
        start = time.perf_counter()
        for q in layers:
            q.matmul(inputs[q.in_features])
        return time.perf_counter() - start

    best = {"one": float("inf"), "all": float("inf")}
    for _ in range(rounds):
        for choice, limit in limits.items():
            module.set_one_thread_bytes(limit)
            one_pass()  # the first pass of a setting wakes (or parks) the pool's threads
            best[choice] = min(best[choice], one_pass())
    choice = min(best, key=best.get)
    module.set_one_thread_bytes(limits[choice])
    return (f"{choice} thread{'s' if choice == 'all' else ''} (a batch-1 pass of the weights: "
            f"one thread {best['one'] * 1e3:.2f} ms, all {torch.get_num_threads()} threads "
            f"{best['all'] * 1e3:.2f} ms)")
