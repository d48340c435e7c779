"""Weight-only quantized linears: int8 per output channel, int4 in groups of 32 along K.

Each format has a plain form (codes and scales as ordinary tensors: the dequantize-then-matmul
reference, and what GGUF blocks are read into) and a packed form that torch's CPU kernels run:

    int8   w[n, k] = scale[n] * q[n, k]                      q int8 in [-127, 127]
           torch._weight_int8pack_mm(x, q, scale)
    int4   w[n, k] = scale[n, g] * c[n, k] + minimum[n, g]   c in [0, 15], g = k // 32
           torch._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros)
           where the kernel computes (c - 8) * scale + zero, so zero = minimum + 8 * scale

GGUF's 4-bit types map onto the int4 form exactly (no requantization): Q4_0 is d * (c - 8), so
minimum = -8d; Q4_1 is d * c + m, so minimum = m; Q4_K's sub-blocks of 32 are (d * sc) * c -
(dmin * m), so scale = d * sc and minimum = -dmin * m. GGUF's Q8_0 has one scale per 32 values,
torch's int8 kernel one per output row: Q8_0 rows are requantized per row, which is what
quantizing the dequantized floats gives too (those floats are exactly Q8_0's values).

The activations stay in the model's dtype (float32 on CPU); the kernels take float32 as it is.
On CUDA the quantized weights are dequantized once at load to the model dtype (see
`ModelRunner`): --quantization then saves nothing on the GPU but never fails there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.logging import get_logger

log = get_logger("quant")

# torch's CPU int8 and int4 kernels are vectorized for bfloat16 activations only (float32 ones
# measured 28-200x slower, bench/quant_kernels.py): the matmul's input is cast to bfloat16.
KERNEL_DTYPE = torch.bfloat16
GROUP = 32  # int4 values per scale; GGUF's Q4_0/Q4_1 block and Q4_K's sub-block
_INT4_N_ALIGN = 16  # torch's CPU int4 packing wants N divisible by 16
# torch's bfloat16 int8 kernel reads past the row (garbage out, or a crash) when K is not a
# multiple of 16 (torch 2.13, seen with K = 8, 24, 100): rows are padded with zeros to 32
_INT8_K_ALIGN = 32


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class Int8Plain:
    """q [N, K] int8 and scale [N] float32: w = scale[:, None] * q."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Plain:
        """Symmetric, per output row: the row's largest |w| maps to 127."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def pack(self, dtype: torch.dtype = torch.float32) -> Int8Linear:
        k = self.q.shape[1]
        q = F.pad(self.q, (0, _round_up(k, _INT8_K_ALIGN) - k)).contiguous()
        return Int8Linear(q, self.scale.to(dtype), k)


@dataclass
class Int4Plain:
    """codes [N, K] uint8 in 0..15, scale and minimum [N, K/32] float32 (K a multiple of 32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    in_features: int  # K before padding to a whole group

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Plain:
        """Asymmetric per group of 32 (as GGUF's Q4_1): the group's min and max map to 0 and 15."""
        n, k = weight.shape
        w = F.pad(weight.detach().float(), (0, _round_up(k, GROUP) - k)).view(n, -1, GROUP)
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        return cls(codes.to(torch.uint8).view(n, -1), scale, lo, k)

    def dequantize(self) -> torch.Tensor:
        n = self.codes.shape[0]
        w = self.codes.view(n, -1, GROUP).float() * self.scale[..., None] + self.minimum[..., None]
        return w.view(n, -1)[:, : self.in_features]

    def pack(self, dtype: torch.dtype = torch.float32) -> Int4Linear:
        n, kp = self.codes.shape
        pad = _round_up(n, _INT4_N_ALIGN) - n
        codes = F.pad(self.codes.to(torch.int32), (0, 0, 0, pad))
        scale = F.pad(self.scale, (0, 0, 0, pad))
        zero = F.pad(self.minimum, (0, 0, 0, pad)) + 8 * scale
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale_zeros = torch.stack([scale.t(), zero.t()], dim=2).to(dtype).contiguous()
        return Int4Linear(packed, scale_zeros, n, self.in_features, kp)


class Int8Linear:
    """x @ w.T for an int8 weight with per-row scales, through torch's CPU int8 kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, in_features: int) -> None:
        self.q = q
        self.scale = scale
        self.in_features = in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Int8Linear:
        return Int8Plain.quantize(weight).pack(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xin = x if x.dtype == self.scale.dtype else x.to(self.scale.dtype)
        if self.q.shape[1] != self.in_features:
            xin = F.pad(xin, (0, self.q.shape[1] - self.in_features))
        return torch._weight_int8pack_mm(xin, self.q, self.scale).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (a tied embedding's lookups)."""
        q = self.q.index_select(0, ids)[:, : self.in_features]
        return q.to(dtype) * self.scale.index_select(0, ids)[:, None].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Linear:
    """x @ w.T for an int4 group-32 weight, through torch's CPU int4 kernel."""

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 in_features: int, padded_in: int) -> None:
        self.packed = packed
        self.scale_zeros = scale_zeros
        self.out_features = out_features
        self.in_features = in_features
        self.padded_in = padded_in

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Int4Linear:
        return Int4Plain.quantize(weight).pack(dtype)

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


# -- GGUF blocks into the plain int4 form -------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [N, nb, 18]: d f16, 16 bytes of nibbles (low: values 0-15, high: 16-31)."""
    d, qs = _f16(b[..., 0:2]), b[..., 2:18]
    return torch.cat([qs & 15, qs >> 4], dim=-1), d, -8 * d


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [N, nb, 20]: d f16, m f16, 16 bytes of nibbles."""
    qs = b[..., 4:20]
    return torch.cat([qs & 15, qs >> 4], dim=-1), _f16(b[..., 0:2]), _f16(b[..., 2:4])


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
    return codes.reshape(*b.shape[:-1], 8, 32), d * sc.float(), -dmin * mn.float()


# GGUF type -> (values per block, bytes per block, decoder to codes, scale, minimum)
_INT4_TYPES = {"Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q4_K": (256, 144, _q4_k)}


def int4_from_gguf(type_name: str, raw: torch.Tensor, in_features: int) -> Int4Plain:
    """A GGUF tensor's rows [N, bytes per row] (uint8) of type Q4_0, Q4_1 or Q4_K, as they are."""
    per_block, nbytes, decode = _INT4_TYPES[type_name]
    n = raw.shape[0]
    codes, scale, minimum = decode(raw.reshape(n, -1, nbytes))
    return Int4Plain(codes.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1),
                     in_features)


class GGUFWeights:
    """A GGUF file's own 4-bit projections, by the HF name of the layer, rows in transformers'
    order (llama.cpp stores a Llama's q and k rows permuted for its rotary layout)."""

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

    def int4(self, module_name: str) -> Int4Plain | None:
        """Our layer `module_name` (e.g. layers.3.mlp.gate_up_proj) from the file's int4 blocks,
        or None where the file does not hold all its parts in a type that maps exactly."""
        head, _, leaf = module_name.rpartition(".")
        parts = [self._one(f"model.{head}.{p}") for p in self.FUSED.get(leaf, (leaf,))]
        if any(p is None for p in parts):
            return None
        return Int4Plain(*(torch.cat([getattr(p, f) for p in parts])
                           for f in ("codes", "scale", "minimum")), parts[0].in_features)

    def _one(self, hf_name: str) -> Int4Plain | None:
        name = self.names and self.names.get_name(hf_name)
        t = self.tensors.get(f"{name}.weight")
        if t is None or t.tensor_type.name not in _INT4_TYPES:
            return None
        plain = int4_from_gguf(t.tensor_type.name, torch.from_numpy(np.array(t.data)),
                               int(t.shape[0]))
        leaf = hf_name.rpartition(".")[2]
        if self.arch == "llama" and leaf in ("q_proj", "k_proj"):
            c = self.config
            heads = c["num_attention_heads"] if leaf == "q_proj" else c.get(
                "num_key_value_heads", c["num_attention_heads"])
            n = plain.codes.shape[0]
            # transformers' reverse_permute_weights, as a row order
            rows = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
            plain = Int4Plain(plain.codes[rows], plain.scale[rows], plain.minimum[rows],
                              plain.in_features)
        return plain


MODES = ("none", "int8", "int4")
QuantizedWeight = Int8Linear | Int4Linear


@dataclass
class QuantSummary:
    """What `quantize_model` did, for the start-up log and /get_server_info."""

    mode: str
    from_file: int = 0  # layers whose int4 codes came from the GGUF as they are
    at_load: int = 0  # layers quantized at load from their float weights

    def as_dict(self) -> dict:
        return {"mode": self.mode, "layers_from_file": self.from_file,
                "layers_quantized_at_load": self.at_load}


def _matches(plain: Int4Plain, weight: torch.Tensor) -> bool:
    """Whether `plain` dequantizes to `weight` (to float32 rounding), on every 16th row: a wrong
    name or row order moves nearly every row, and checking all of them doubles the load time."""
    rows = slice(None, None, 16)
    sample = Int4Plain(plain.codes[rows], plain.scale[rows], plain.minimum[rows],
                       plain.in_features)
    return bool((sample.dequantize() - weight[rows].float()).abs().max() <= 1e-6)


def quantize_model(model: nn.Module, mode: str, gguf: GGUFWeights | None, *, packed: bool,
                   dtype: torch.dtype) -> QuantSummary:
    """Quantize every projection (`mode`) and the lm_head and input embedding (int8, per row).

    packed: run from torch's CPU kernels (activations in `dtype`); else dequantize on load into
    the plain weights, in the model's dtype (CUDA: same numbers, no kernel). The lm_head and
    the embedding stay int8 under int4 too, as llama.cpp's files keep them at 6-8 bits.
    """
    from services.scheduler.models.layers import Linear  # the model imports this module

    summary = QuantSummary(mode)
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight is None:
            continue
        weight = module.weight
        plain: Int8Plain | Int4Plain | None = None
        if mode == "int4" and gguf is not None:
            plain = gguf.int4(name)
            # the file's codes must give back the floats transformers read from it, or the
            # name or row mapping is off for this family: then quantize the floats instead
            if plain is not None and not _matches(plain, weight):
                log.warning(f"{name}: the GGUF's int4 blocks do not match its float weights; "
                            "quantizing the floats at load")
                plain = None
        summary.from_file += plain is not None
        summary.at_load += plain is None
        if plain is None:
            plain = Int8Plain.quantize(weight) if mode == "int8" else Int4Plain.quantize(weight)
        if packed:
            module.quantized = plain.pack(dtype)
            module.weight = None
        else:
            weight.data.copy_(plain.dequantize())
    embed = model.embed_tokens
    lm = Int8Plain.quantize(model.lm_weight)
    if not packed:
        model.lm_weight.data.copy_(lm.dequantize())
        if model.lm_head is not None:
            embed.weight.data.copy_(Int8Plain.quantize(embed.weight).dequantize())
        return summary
    model.lm_quantized = lm.pack(dtype)
    model.embed_quantized = (model.lm_quantized if model.lm_head is None
                             else Int8Plain.quantize(embed.weight).pack(dtype))
    embed.weight = None
    if model.lm_head is not None:
        model.lm_head.weight = None
    return summary
