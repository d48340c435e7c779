"""Our Llama-family forward over a flat packed batch (no padding), reading a paged KV cache.

RMSNorm, rotary embeddings (default and llama3 scaling), grouped-query attention through an
attention backend, SwiGLU MLP. QKV and gate/up projections are fused into one matmul each. On
CPU the projections and the lm_head run through oneDNN from packed copies of their weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.attention.base import AttentionBackend, AttentionMetadata

RopeTables = tuple[torch.Tensor, torch.Tensor]


def onednn_pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A [out, in] weight (cast to `dtype`) reordered for oneDNN's inner-product kernel (CPU).

    Why: torch runs a float32 F.linear through MKL, which on AMD CPUs takes a path about 2.5x
    slower than oneDNN's AVX-512 kernels (measured on an EPYC: 110 against 265 GFLOP/s per
    core). The result is float32 all the same, only summed in another order. A bfloat16 copy
    runs on AVX512-BF16 at about twice that again.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype))


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x @ packed.T (+ bias), computed in the packed weight's dtype, returned in x's."""
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "")
    return out.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear that, once `pack()`ed, runs from a oneDNN copy of its weight (CPU)."""

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None

    def pack(self, dtype: torch.dtype | None = None) -> None:
        """Run from a oneDNN copy from now on; the plain weight is freed (it would double the
        memory the projections hold)."""
        self.packed = onednn_pack(self.weight, dtype)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(self.packed.dtype)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.packed, self.packed_bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused pass, bit-identical to the float32 steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.get("rope_type", rope.get("type", "default")) == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class Rotary(nn.Module):
    def __init__(self, config: dict, head_dim: int, max_len: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), _inv_freq(config, head_dim))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_len, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

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


class Attention(nn.Module):
    def __init__(self, config: dict, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.get("attention_bias", False)
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=bias)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        self.backend = backend

    def forward(self, x, rope: RopeTables, meta: AttentionMetadata, k_cache, v_cache):
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        # q and k sit side by side in each row of qkv: rotate both in one pass, in place
        Rotary.rotate_(qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim), rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        bias = config.get("mlp_bias", False)
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = MLP(config)

    def forward(self, x, rope: RopeTables, meta, k_cache, v_cache):
        """Updates the residual stream `x` in place and returns it."""
        x += self.self_attn(self.input_layernorm(x), rope, meta, k_cache, v_cache)
        x += self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: dict, backend: AttentionBackend, max_len: int) -> None:
        super().__init__()
        self.config = config
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        rotary = Rotary(config, head_dim, max_len)
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, backend) for _ in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(hidden, config["vocab_size"], bias=False)
        self.rotary = rotary
        self.lm_packed: torch.Tensor | None = None

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
        """Logits of the tokens at `logits_indices` only: the rest of a prefill needs none."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, meta, k_cache, v_cache)
        x = self.norm(x[logits_indices])
        return self.logits(x).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_packed is not None:
            return onednn_linear(x, self.lm_packed, None)
        return F.linear(x, self.lm_weight)

    def packed_bytes(self) -> int:
        """Memory held by the oneDNN copies (0 until `pack_for_cpu`)."""
        packed = [m.packed for m in self.modules()
                  if isinstance(m, Linear) and m.packed is not None]
        if self.lm_packed is not None:
            packed.append(self.lm_packed)
        return sum(p.numel() * p.element_size() for p in packed)

    def pack_for_cpu(self, dtype: torch.dtype | None = None) -> None:
        """Run every projection and the lm_head through oneDNN (after the weights are final),
        from copies in `dtype` (default: the weights' own).

        The projections' plain weights are freed; a tied lm_head's copy comes on top of the
        embedding, which still serves lookups."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(dtype)
        self.lm_packed = onednn_pack(self.lm_weight, dtype)
        if self.lm_head is not None:
            self.lm_head.weight = None

    def load_weights(self, path: Path) -> None:
        """Read HF-named safetensors, fusing q/k/v and gate/up as we go."""
        from safetensors import safe_open

        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
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
                    if part in fused:
                        new_part, shard = fused[part]
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

    def _shard_sizes(self, part: str, total: int) -> list[int]:
        if part == "gate_up_proj":
            return [total // 2, total // 2]
        attn = self.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
