"""LoRA adapters (PEFT's on-disk format) served beside one base model, mixed in one batch.

An adapter adds x @ A @ B * scale to a projection. Our q/k/v and gate/up projections are fused
(layers.py), so an adapter's per-shard factors are laid out block-wise for the fused Linear:

    A_fused = [A_q | A_k | A_v]            [in, 3r]   (a shard the adapter skips stays zero)
    B_fused = diag(B_q, B_k, B_v) * scale  [3r, out]  (each B writes only its shard's columns)

so one x @ A_fused @ B_fused per fused projection adds every targeted shard's part. Per step,
each Linear's adapter slot gets a `LoraBatch`: the step's active adapters stacked (zero-padded
to the widest) and, per adapter, the rows that use it; rows of the base get nothing. That is a
segmented low-rank product (Punica/S-LoRA), not a weight merge and not a forward per adapter.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.scheduler.models.linear import Linear
from services.scheduler.native.ops import fused_ops

# PEFT's module name -> (our Linear's name inside a decoder layer, its shard; None: not fused)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}
# PEFT options that change the product itself; refused rather than silently served wrong
UNSUPPORTED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_pattern")


@dataclass
class LoraAdapter:
    """One adapter in CPU memory: per fused Linear (its name in the model), A [in, S*r] and
    B [S*r, out] with the scale folded into B."""

    name: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def lora_scale(config: dict) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA (PEFT's `use_rslora`)."""
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_config(path: Path, max_rank: int) -> dict:
    """adapter_config.json, validated: a ValueError naming the file or field otherwise."""
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {path}: no such directory")
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: adapter_config.json missing")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json unreadable ({e})") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config['peft_type']!r} is not LORA")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json has no positive rank 'r'")
    if config["r"] > max_rank:
        raise ValueError(f"LoRA adapter {path}: rank {config['r']} exceeds --max-lora-rank "
                         f"{max_rank}")
    for key in UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"LoRA adapter {path}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={config['bias']!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex: the tensors themselves are checked on load
        targets = []
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"LoRA adapter {path}: target module(s) {unknown} not in the model "
                         f"(serves {sorted(TARGETS)})")
    return config


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, or a ValueError naming it when missing or corrupt."""
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors missing")
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors corrupt ({e})") from e


def _split_key(key: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (3, 'q_proj', 'A')."""
    parts = key.split(".")
    if "layers" not in parts or len(parts) < 4 or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"unexpected tensor {key!r}")
    layer = int(parts[parts.index("layers") + 1])
    return layer, parts[-3], parts[-2][-1]


def _factors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], dict]:
    """(layer, PEFT module) -> {'A': [r, in], 'B': [out, r]}, validated against TARGETS."""
    found: dict[tuple[int, str], dict] = {}
    for key, tensor in tensors.items():
        try:
            layer, module, which = _split_key(key)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {path}: {e}") from e
        if module not in TARGETS:
            raise ValueError(f"LoRA adapter {path}: target module {module!r} not in the model")
        found.setdefault((layer, module), {})[which] = tensor
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} lacks lora_A/lora_B")
    return found


def load_adapter(name: str, path: Path, model: nn.Module, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read a PEFT adapter directory and lay it out for `model`'s fused Linears; every
    problem (missing or corrupt file, rank over `max_rank`, a module the model lacks, shapes of
    another base model) is a ValueError naming it. Weights stay in `dtype` (float32, or bf16 for
    a bf16 base) whatever the base's kind, quantized included."""
    path = Path(path)
    config = read_config(path, max_rank)
    r, scale = config["r"], lora_scale(config)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in _factors(path, read_tensors(path)).items():
        suffix, shard = TARGETS[module]
        target = f"layers.{layer}.{suffix}"
        if target not in linears:
            raise ValueError(f"LoRA adapter {path}: the model has no {target} (layer {layer})")
        ranges = _shard_ranges(target, linears[target], model)
        if target not in weights:
            linear = linears[target]
            weights[target] = (torch.zeros(linear.in_features, len(ranges) * r),
                               torch.zeros(len(ranges) * r, linear.out_features))
        where = f"{path}: layer {layer} {module}"
        _place(weights[target], ranges, shard or 0, r, pair["A"], pair["B"] * scale, where)
    return LoraAdapter(name, r, {t: (a.to(dtype).contiguous(), b.to(dtype).contiguous())
                                 for t, (a, b) in weights.items()})


def _shard_ranges(target: str, linear: Linear, model: nn.Module) -> list[tuple[int, int]]:
    """The output columns of each shard of a fused Linear (one shard when not fused)."""
    out = linear.out_features
    if target.endswith("gate_up_proj"):
        return [(0, out // 2), (out // 2, out)]
    if target.endswith("qkv_proj"):
        attn = model.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    return [(0, out)]


def _place(ab: tuple[torch.Tensor, torch.Tensor], ranges: list[tuple[int, int]], s: int,
           r: int, lora_a: torch.Tensor, lora_b: torch.Tensor, where: str) -> None:
    """Copy PEFT's A [r, in] and B [out_shard, r] into shard s's block of the fused factors."""
    a, b = ab
    lo, hi = ranges[s]
    if tuple(lora_a.shape) != (r, a.shape[0]) or tuple(lora_b.shape) != (hi - lo, r):
        raise ValueError(
            f"LoRA adapter {where} has A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}; the "
            f"model wants A ({r}, {a.shape[0]}), B ({hi - lo}, {r}) (made for another base "
            "model?)")
    a[:, s * r:(s + 1) * r] = lora_a.float().T
    b[s * r:(s + 1) * r, lo:hi] = lora_b.float().T


# A group of at most this many rows (a decode step's, for one adapter) runs through the C++
# kernel (native ops' lora_add_): one call that reads each factor once for all its rows, on the
# calling thread. Above it, two float32 matmuls (a prefill chunk's rows). Measured on a 2-core
# AVX2 EPYC, one thread, SmolLM2's fused qkv (576 -> 3 x 16 -> 960): 7 us against 38 us for
# torch's gather, two matmuls and scatter at 1 row, 15 against 46 at 4; at 16 rows 65 against
# 83, where torch's matmuls split over both cores and the kernel does not.
KERNEL_ROWS = 8


@dataclass
class Group:
    """The packed rows that use one adapter: `rows` a slice when contiguous, else an index;
    `start`/`count`/`index` the same for the kernel (an empty index: start..start+count)."""

    slot: int
    rows: slice | torch.Tensor
    start: int
    count: int
    index: torch.Tensor


class LoraBatch:
    """One step's adapters for one Linear: per active adapter its A [in, R], B [R, out] (R the
    widest active rank, zero-padded) and B's non-zero columns per row ([R, 2] int32: a fused
    projection's shards write only their own columns), and the groups of rows that use each.
    Base rows are in no group and get nothing."""

    def __init__(self, stack: Stack, groups: list[Group]) -> None:
        self.a, self.b, self.cols, self.groups = stack.a, stack.b, stack.cols, groups
        self.at = stack.at

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(out) if x.dim() == 2 else None
        for g in self.groups:
            a, b = self.a[g.slot], self.b[g.slot]
            if ops is not None and g.count <= KERNEL_ROWS:
                kernel_add(ops, out, x, self.at[g.slot], b, self.cols[g.slot], g)
            else:
                torch_add(out, x, a, b, g)
        return out


def kernel_add(ops, out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, b: torch.Tensor,
               cols: torch.Tensor, g: Group) -> None:
    """out[g's rows] += (x[rows] @ at.T) @ b in the C++ kernel (at: A transposed)."""
    ops.lora_add_(out, x, at, b, cols, g.index, g.start, g.count)


def torch_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              g: Group) -> None:
    """The same in torch (a prefill chunk's rows, or where the kernel is not built)."""
    if isinstance(g.rows, slice):  # .to: float32 factors for bf16 activations
        out[g.rows] += ((x[g.rows].to(a.dtype) @ a) @ b).to(out.dtype)
    else:
        part = (x.index_select(0, g.rows).to(a.dtype) @ a) @ b
        out.index_add_(0, g.rows, part.to(out.dtype))


@dataclass
class Stack:
    """One Linear's factors for the step's active adapters, slot i the i-th adapter."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]
    cols: list[torch.Tensor]
    at: list[torch.Tensor]  # A transposed, [R, in] contiguous: the kernel's dot products


def nonzero_columns(b: torch.Tensor) -> torch.Tensor:
    """Per row of b [R, N], the columns [lo, hi) outside which it is zero ([0, 0) for a zero
    row), int32 [R, 2]: the kernel skips the rest."""
    nz = b != 0
    n = b.shape[1]
    lo = nz.int().argmax(1)
    hi = n - nz.flip(1).int().argmax(1)
    empty = ~nz.any(1)
    lo[empty], hi[empty] = 0, 0
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


def _groups(row_adapter: list[int], device: torch.device) -> list[Group]:
    """Per adapter slot, its rows (-1 in row_adapter: the base's)."""
    rows: dict[int, list[int]] = {}
    for t, i in enumerate(row_adapter):
        if i >= 0:
            rows.setdefault(i, []).append(t)
    groups: list[Group] = []
    empty = torch.empty(0, dtype=torch.long)
    for i, ts in rows.items():
        if ts[-1] - ts[0] + 1 == len(ts):
            groups.append(Group(i, slice(ts[0], ts[-1] + 1), ts[0], len(ts), empty))
        else:
            index = torch.tensor(ts, dtype=torch.long)
            groups.append(Group(i, index.to(device), 0, len(ts), index))
    return groups


class LoraSet:
    """The adapters a model serves: name -> path registered up front, weights read from disk
    on first use into CPU memory and evicted least-recently-used beyond `max_loaded`. Each
    step, `activate` hands every Linear its LoraBatch; the stacks are rebuilt only when the
    step's set of adapters changes."""

    def __init__(self, model: nn.Module, paths: dict[str, Path], max_rank: int,
                 max_per_batch: int, dtype: torch.dtype = torch.float32,
                 max_loaded: int | None = None, device: torch.device | str = "cpu") -> None:
        self.model, self.paths, self.max_rank = model, dict(paths), max_rank
        self.device = torch.device(device)  # where the step's stacks live (CPU memory keeps
        # the loaded adapters; only the active ones are copied, once per change of the set)
        self.max_per_batch, self.dtype = max_per_batch, dtype
        self.max_loaded = max(max_loaded or 2 * max_per_batch, max_per_batch)
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._stacks: tuple[tuple[str, ...], dict[str, Stack]] = ((), {})
        self._layout: tuple = ((), ())  # the last step's adapters and rows: its slots are set

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, read now if it is not in memory (a KeyError for an unknown
        name, a ValueError for a bad directory)."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name]
        adapter = load_adapter(name, self.paths[name], self.model, self.max_rank, self.dtype)
        self.loaded[name] = adapter
        while len(self.loaded) > self.max_loaded:
            self.loaded.popitem(last=False)
        return adapter

    def add(self, name: str, path: Path) -> LoraAdapter:
        """Serve one more adapter: read and validated now (a ValueError naming the problem
        leaves the set as it was), then kept like any other."""
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, Path(path), self.model, self.max_rank, self.dtype)
        self.paths[name] = Path(path)
        self.loaded[name] = adapter
        while len(self.loaded) > self.max_loaded:
            self.loaded.popitem(last=False)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (no running request may use it: the engine drains it first)."""
        del self.paths[name]
        self.loaded.pop(name, None)
        if name in self._stacks[0]:  # the stacks and the slots set from them
            self._stacks, self._layout = ((), {}), ((), ())

    def activate(self, names: Sequence[str | None], num_rows: Sequence[int]) -> None:
        """Set every Linear's slot for a step whose request b has `num_rows[b]` packed rows
        and uses adapter `names[b]` (None: the base). A step of the base alone empties them;
        a step laid out as the last one keeps its slots."""
        active = tuple(dict.fromkeys(n for n in names if n is not None))
        if len(active) > self.max_per_batch:
            raise ValueError(f"{len(active)} adapters in one step, over --max-loras-per-batch "
                             f"{self.max_per_batch}")
        slot = {n: i for i, n in enumerate(active)}
        row_adapter: list[int] = []
        for name, n in zip(names, num_rows, strict=True):
            row_adapter += [slot[name] if name is not None else -1] * n
        layout = (active, tuple(row_adapter) if active else ())
        if layout == self._layout:
            return
        self._layout = layout
        stacks = self._stacked(active) if active else {}
        groups = _groups(row_adapter, self.device)
        for target, linear in self.linears.items():
            stack = stacks.get(target)
            linear.set_adapter(None if stack is None else LoraBatch(stack, groups))

    def _stacked(self, active: tuple[str, ...]) -> dict[str, Stack]:
        """Per Linear any active adapter targets, its Stack: cached while the step's active
        set stays the same."""
        if self._stacks[0] == active:
            return self._stacks[1]
        adapters = [self.get(n) for n in active]
        stacks: dict[str, Stack] = {}
        for target in {t for ad in adapters for t in ad.weights}:
            linear = self.linears[target]
            width = max(ad.weights[target][0].shape[1] for ad in adapters if target in ad.weights)
            stack = Stack([], [], [], [])
            for ad in adapters:
                a = torch.zeros(linear.in_features, width, dtype=self.dtype)
                b = torch.zeros(width, linear.out_features, dtype=self.dtype)
                if target in ad.weights:
                    wa, wb = ad.weights[target]
                    a[:, : wa.shape[1]] = wa
                    b[: wb.shape[0]] = wb
                stack.cols.append(nonzero_columns(b))
                stack.a.append(a.to(self.device))
                stack.at.append(a.T.contiguous())
                stack.b.append(b.to(self.device))
            stacks[target] = stack
        self._stacks = (active, stacks)
        return stacks
