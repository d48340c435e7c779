"""The decoder every family shares, over a flat packed batch (no padding) and a paged KV cache.

RMSNorm, rotary embeddings (default, linear and llama3 scaling), grouped-query attention
through an attention backend (optionally inside a sliding window), a gated MLP (SwiGLU or
GeGLU). QKV and gate/up projections are fused into one matmul each. On CPU the projections and
the lm_head run from packed copies of their weights: float32 ones from our C++ tiles on AVX-512
CPUs (quant.Float32Tiles), the rest through oneDNN.

A family (llama.py, qwen2.py, ...) is an `Arch`: the handful of choices it makes differently,
read from its config, plus, where a layer is shaped differently (Gemma 3), a layer class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.models.linear import Linear, onednn_linear, onednn_pack, tiled_weight
from services.scheduler.models.quant import (
    BF16_LM_HEAD_ROWS,
    Bf16Tiles,
    Float32Tiles,
    Int8Linear,
    QuantizedWeight,
)
from services.scheduler.native.ops import fused_ops

RopeTables = tuple[torch.Tensor, torch.Tensor]
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# -- the fused small ops ------------------------------------------------------------------------
#
# On CPU, in float32 and bfloat16, the decoder's small ops run as one C++ call each
# (native/ops_cpu.cpp through native.ops: residual add + RMSNorm, rotary on q and k,
# activation-and-multiply): a batch-1 decode step is mostly such calls, each a few microseconds
# of dispatch around little work. Elsewhere (CUDA, TOKENLINE_CPU_KERNELS=0, no compiler) the
# same functions run the torch ops they replace, with the same results as before they existed.

# HOT_PATH: the decoder's forward reads its submodules from `_modules` and calls their
# `forward` itself. nn.Module's __getattr__ (every submodule and Parameter read) and __call__
# (its hook checks) cost about a microsecond each, some 15 per layer: 0.4-0.6 ms of a batch-1
# step that runs in 7-9 ms with --quantization int4 (measured in one process). The engine
# registers no hooks; bench.step_profile patches the classes' `forward`, which this still
# calls.


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """residual += x, then norm(residual): the residual stream updated in place and the next
    sublayer's input returned (fused: written over x, which the caller no longer needs)."""
    ops = fused_ops(x)
    weight = norm.weight  # a Parameter: each read goes through nn.Module.__getattr__
    if ops is not None and norm.offset == 0 and residual.dtype == x.dtype and (
        weight.dtype in (x.dtype, torch.float32)
    ):
        return ops.add_rms_norm_(residual, x, weight, norm.eps)
    residual += x
    return norm(residual)


def rotary_(x: torch.Tensor, heads: int, rope: StepRope) -> None:
    """The first `heads` heads of x [T, H, D] (q's and k's, side by side in qkv), rotated in
    place at the step's positions."""
    ops = fused_ops(x)
    if ops is not None:
        ops.rotary_(x, heads, rope.positions, rope.rotary.cos, rope.rotary.sin)
    else:
        Rotary.rotate_(x[:, :heads], rope.tables())


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a fused gate_up [T, 2I]."""
    ops = fused_ops(gate_up)
    if ops is not None:
        if activation == "silu":
            return ops.silu_and_mul(gate_up)
        if activation == "gelu_pytorch_tanh":
            return ops.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = F.silu(gate, inplace=True) if activation == "silu" else ACTIVATIONS[activation](gate)
    return gate.mul_(up)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight): offset 0 for Llama and most, 1 for Gemma (whose weights
    are stored as a difference from one, and whose product is taken in float32). Once the
    weights are loaded, `fold_offset` adds the offset into them, one op less per call."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset
        self.upcast = offset != 0  # Gemma: (x * w) rounded once, not x rounded then * w

    def fold_offset(self) -> None:
        with torch.no_grad():
            self.weight.add_(self.offset)
        self.offset = 0.0

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """rms_norm(x) * weight; with `inplace`, written over x (q and k heads inside qkv)."""
        ops = fused_ops(x)
        if ops is not None and self.offset == 0 and (
            self.weight.dtype in (x.dtype, torch.float32)
        ) and x.stride(-1) == 1 and x.dim() in (2, 3):
            return ops.rms_norm_(x, self.weight, self.eps, x if inplace else torch.empty_like(x))
        if inplace:
            return x.copy_(self._torch(x))
        return self._torch(x)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.offset == 0 else self.weight.float() + self.offset
        if x.dtype == torch.float32:  # one fused pass, bit-identical to the float32 steps below
            return F.rms_norm(x, self.weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.upcast:
            return (xf * weight.float()).to(x.dtype)
        return weight * xf.to(x.dtype)


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """The rope dict of a config (transformers 5's `rope_parameters`, or the older
    `rope_scaling` + `rope_theta`), per layer type where a family keys it so (Gemma 3)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    theta = rope["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope["rope_type"]
    if kind == "linear":
        return inv / rope["factor"]
    if kind == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    if kind != "default":  # the config check refuses these first; never compute them wrongly
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv


class Rotary:
    """cos/sin tables of one rope setting. Plain tensors, not buffers: they stay float32 (and
    positions exact) whatever dtype the model is cast to."""

    def __init__(self, rope: dict, head_dim: int, max_len: int) -> None:
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq(rope, head_dim))
        self.cos = freqs.cos()  # [max_len, D/2]
        self.sin = freqs.sin()

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        return StepRope(self, positions, dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and sin of the step's positions, [T, 1, D/2]: looked up once for every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin

    @staticmethod
    def rotate_(x: torch.Tensor, rope: RopeTables) -> None:
        """x [T, H, D], in place: rotate the two halves of each head (HF's 'rotate_half')."""
        cos, sin = rope
        x1, x2 = x.chunk(2, dim=-1)
        r1 = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1 * sin)  # not addcmul: a fused multiply-add rounds differently
        x1.copy_(r1)


@dataclass
class StepRope:
    """One rope setting at one step's positions. The C++ op reads the tables by position; the
    torch path looks cos and sin up once per step, when the first layer asks."""

    rotary: Rotary
    positions: torch.Tensor  # [T] int64
    dtype: torch.dtype
    _tables: RopeTables | None = None

    def tables(self) -> RopeTables:
        if self._tables is None:
            self._tables = self.rotary.tables(self.positions, self.dtype)
        return self._tables


@dataclass(frozen=True)
class Arch:
    """What a family does differently from Llama, read from its config (defaults: Llama)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's (1 + w)
    activation: str = "silu"  # of the MLP's gate: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    windows: tuple[int | None, ...] = ()  # per layer: sliding window, None for full attention
    ropes: tuple[dict, ...] = ()  # per layer rope parameters; () for the config's one


def windows_from_layer_types(config: dict) -> tuple[int | None, ...]:
    """transformers' `layer_types` ('sliding_attention' / 'full_attention') as windows."""
    window = config.get("sliding_window")
    types = config.get("layer_types") or ()
    return tuple(window if t == "sliding_attention" else None for t in types)


class Attention(nn.Module):
    def __init__(self, config: dict, arch: Arch, window: int | None, rotary: Rotary,
                 backend: AttentionBackend) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=arch.o_bias)
        if arch.qk_norm:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, eps, arch.norm_offset)
        self.qk_norm = arch.qk_norm
        self.scale = arch.attn_scale or self.head_dim**-0.5
        self.window = window
        self.rotary = rotary
        self.backend = backend

    def forward(self, x, rope: StepRope, meta: AttentionMetadata, k_cache, v_cache):
        m = self._modules  # submodules called directly: see HOT_PATH
        # [T, Hq + 2 Hkv, D]: q, k and v heads are views of the projection's rows, and q and k
        # sit side by side, so one call rotates both (after their norms, in place, where any)
        heads = m["qkv_proj"].forward(x).view(-1, self.num_heads + 2 * self.num_kv_heads,
                                              self.head_dim)
        # split_with_sizes: Tensor.split is a Python wrapper around it (a few us at batch 1)
        q, k, v = heads.split_with_sizes(self.head_split, dim=1)
        if self.qk_norm:
            m["q_norm"].forward(q, inplace=True)
            m["k_norm"].forward(k, inplace=True)
        rotary_(heads, self.num_heads + self.num_kv_heads, rope)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, window=self.window)
        return m["o_proj"].forward(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, config: dict, arch: Arch) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=arch.mlp_bias)
        self.down_proj = Linear(inter, hidden, bias=arch.mlp_bias)
        self.activation = arch.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._modules  # see HOT_PATH
        return m["down_proj"].forward(act_and_mul(m["gate_up_proj"].forward(x), self.activation))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream.

    A layer takes and returns (x, residual): x is the last sublayer's output, not yet added
    to the residual stream; the next norm adds it (one fused pass with the norm). The first
    layer gets residual None: x is the embedding, the stream itself.

        residual += x; h = norm(residual)    add_rms_norm_, in place
        residual += attn(h); h = norm(residual)
        return mlp(h), residual
    """

    def __init__(self, config: dict, arch: Arch, window: int | None, rotary: Rotary,
                 backend: AttentionBackend) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, arch.norm_offset)
        self.self_attn = Attention(config, arch, window, rotary, backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, arch.norm_offset)
        self.mlp = MLP(config, arch)

    def forward(self, x, residual: torch.Tensor | None, rope: StepRope, meta, k_cache, v_cache):
        m = self._modules  # see HOT_PATH
        if residual is None:
            residual, h = x, m["input_layernorm"].forward(x)
        else:
            h = add_rms_norm_(residual, x, m["input_layernorm"])
        h = add_rms_norm_(residual, m["self_attn"].forward(h, rope, meta, k_cache, v_cache),
                          m["post_attention_layernorm"])
        return m["mlp"].forward(h), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, lm_head. A family subclass sets `arch()` (and
    `layer_class` where its layers are shaped differently)."""

    layer_class: type[nn.Module] = DecoderLayer

    @classmethod
    def arch(cls, config: dict) -> Arch:
        bias = bool(config.get("attention_bias", False))
        return Arch(qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))

    def __init__(self, config: dict, backend: AttentionBackend, max_len: int) -> None:
        super().__init__()
        self.config = config
        arch = self.arch(config)
        self.arch_ = arch
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        num_layers = config["num_hidden_layers"]
        windows = arch.windows or (None,) * num_layers
        ropes = arch.ropes or (rope_parameters(config),) * num_layers
        assert len(windows) == len(ropes) == num_layers, "one window and rope per layer"
        # layers with the same rope share one table (Gemma 3 has two: local and global)
        self.rotaries: list[Rotary] = []
        index: dict[str, int] = {}
        self.rope_index: list[int] = []
        for rope in ropes:
            key = repr(sorted(rope.items()))
            if key not in index:
                index[key] = len(self.rotaries)
                self.rotaries.append(Rotary(rope, head_dim, max_len))
            self.rope_index.append(index[key])
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            self.layer_class(config, arch, windows[i], self.rotaries[self.rope_index[i]], backend)
            for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), arch.norm_offset)
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(hidden, config["vocab_size"], bias=False)
        self.lm_packed: torch.Tensor | None = None
        self.lm_tiled: Float32Tiles | Bf16Tiles | None = None
        self.lm_quantized: QuantizedWeight | None = None
        self.embed_quantized: Int8Linear | None = None  # the lm_head's own when tied
        self.windows = windows
        if self.embed_tokens.weight.is_cpu:
            fused_ops(self.embed_tokens.weight)  # built with the model, not in the first step

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the tokens at `logits_indices` only: the rest of a prefill needs none.
        The layers run are those `kv_caches` holds a cache for: all of them, or the first L
        of a self-speculative draft (ModelRunner.first_layers), whose last one then goes
        straight to the final norm and the lm_head."""
        n = len(kv_caches)
        assert n <= len(self.layers), f"{n} KV caches for {len(self.layers)} layers"
        x = self.embed(input_ids)
        if self.arch_.embed_scale != 1.0:
            x = x * torch.tensor(self.arch_.embed_scale, dtype=x.dtype)
        ropes = [r.at(positions, x.dtype) for r in self.rotaries]
        residual = None
        for layer, i, (k_cache, v_cache) in zip(islice(self.layers, n), self.rope_index[:n],
                                                kv_caches, strict=True):
            x, residual = layer.forward(x, residual, ropes[i], meta, k_cache, v_cache)
        if residual is None:
            return self.logits(self.norm(x[logits_indices])).float()
        x = add_rms_norm_(residual[logits_indices], x[logits_indices], self.norm)
        return self.logits(x).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return self.embed_quantized.rows(input_ids, self.norm.weight.dtype)
        return self.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_quantized is not None:
            return self.lm_quantized.matmul(x)
        if self.lm_tiled is not None:
            return self.lm_tiled.matmul(x)
        if self.lm_packed is not None:
            return onednn_linear(x, self.lm_packed, None)
        return F.linear(x, self.lm_weight)

    def packed_bytes(self) -> int:
        """Memory held by the oneDNN copies, float32 tiles and quantized weights (0 until
        packed)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        packed = [m.packed for m in linears if m.packed is not None]
        if self.lm_packed is not None:
            packed.append(self.lm_packed)
        tiled = [m.tiled for m in linears if m.tiled is not None]
        if self.lm_tiled is not None:
            tiled.append(self.lm_tiled)
        quantized = {id(q): q for q in [m.quantized for m in linears]
                     + [self.lm_quantized, self.embed_quantized] if q is not None}
        return (sum(p.numel() * p.element_size() for p in packed)
                + sum(t.nbytes for t in tiled) + sum(q.nbytes for q in quantized.values()))

    def linear_widths(self) -> list[int]:
        """The input width of every projection and of the lm_head."""
        return [m.in_features for m in self.modules() if isinstance(m, Linear)] + [
            self.lm_weight.shape[1]]

    def pack_for_cpu(self, dtype: torch.dtype | None = None, tiles: bool = False) -> None:
        """Run every projection and the lm_head through oneDNN (after the weights are final),
        from copies in `dtype` (default: the weights' own), or with `tiles` from our tiles in
        `dtype` (linear.tiled_weight: float32, or bfloat16 beside a oneDNN copy).

        The projections' plain weights are freed; a tied lm_head's copy comes on top of the
        embedding, which still serves lookups."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(dtype, tiles)
        if tiles:
            self.lm_tiled = tiled_weight(self.lm_weight, None, dtype, BF16_LM_HEAD_ROWS)
        else:
            self.lm_packed = onednn_pack(self.lm_weight, dtype)
        if self.lm_head is not None:
            self.lm_head.weight = None

    # q/k/v and gate/up checkpoints' names -> (our fused parameter, its shard). Families that
    # ship them fused already (Phi-3) simply match our names.
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, path: Path) -> None:
        """Read HF-named safetensors, fusing q/k/v and gate/up as we go."""
        from safetensors import safe_open

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors in {path}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if "rotary_emb" in name:
                        continue
                    tensor = f.get_tensor(name)
                    target = name.removeprefix("model.")
                    if target == "lm_head.weight" and self.lm_head is None:
                        continue
                    part = target.split(".")[-2]
                    if part in self.FUSED:
                        new_part, shard = self.FUSED[part]
                        target = target.replace(part, new_part)
                        param = params[target]
                        sizes = self._shard_sizes(new_part, param.shape[0])
                        start = sum(sizes[:shard])
                        param.data[start : start + sizes[shard]].copy_(tensor)
                    else:
                        params[target].data.copy_(tensor)
                    loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from {path}: {sorted(missing)[:5]}")
        for module in self.modules():
            if isinstance(module, RMSNorm) and module.offset:
                module.fold_offset()

    def _shard_sizes(self, part: str, total: int) -> list[int]:
        if part == "gate_up_proj":
            return [total // 2, total // 2]
        attn = self.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
