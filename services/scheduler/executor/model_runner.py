"""Owns the model and the KV tensors; turns a scheduled batch into one packed forward pass."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from common import malloc
from common.logging import get_logger
from services.scheduler.attention.base import AttentionMetadata
from services.scheduler.attention.registry import get_backend
from services.scheduler.attention.torch_backend import (
    AMX_BF16,
    SdpaRoute,
    TorchBackend,
    cpu_kernels,
    native_kernels,
    prefill_kernels,
)
from services.scheduler.models import model_class, quant
from services.scheduler.models.lora import LoraSet
from services.scheduler.models.quantize import quantize_model
from services.scheduler.native import cpu_flags
from services.scheduler.native.ops import fused_ops

log = get_logger("model_runner")

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sdpa_route(dtype: torch.dtype) -> SdpaRoute | None:
    """What goes to torch's SDPA beside our prefill kernel: AMX_BF16 in bfloat16 where the CPU
    has AMX, nothing elsewhere. TOKENLINE_SDPA_PROMPTS_FROM=N moves the fresh-prompt crossover
    (in any dtype, extends as AMX_BF16), =off keeps every prompt and extend in our kernel."""
    raw = os.environ.get("TOKENLINE_SDPA_PROMPTS_FROM")
    if raw is not None:
        if raw == "off":
            return None
        if not raw.isdigit() or int(raw) < 2:
            raise ValueError(f"TOKENLINE_SDPA_PROMPTS_FROM must be off or an integer >= 2, "
                             f"not {raw!r}")
        return replace(AMX_BF16, prompts_from=int(raw))
    if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        return AMX_BF16
    return None


def _onednn_enabled() -> bool:
    """oneDNN for the CPU projections our float32 tiles do not run (bfloat16, or float32 where
    quant.float32_tiles_missing says why); TOKENLINE_ONEDNN=0 falls back to F.linear."""
    return torch.backends.mkldnn.is_available() and os.environ.get("TOKENLINE_ONEDNN", "1") != "0"


def _cpu_bf16_linears(device: torch.device) -> bool:
    """Whether bfloat16 projections run natively here (oneDNN on AVX512-BF16 or AMX)."""
    return device.type == "cpu" and _onednn_enabled() and (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _cpu_bf16_attention_missing() -> str | None:
    """Why bfloat16 activations, attention and KV cache would not be fast on this CPU (None:
    they are): that needs the C++ decode kernel built with AVX512-BF16."""
    native = native_kernels()
    if native.module is None:
        return f"no C++ decode kernel ({native.missing or native.error})"
    if not native.module.fast_bf16():
        return "this CPU has no AVX512-BF16"
    return None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@contextlib.contextmanager
def _parameters_left_uninitialized() -> Iterator[None]:
    """Modules built inside skip their random initialization: load_weights overwrites every
    parameter (and refuses a checkpoint that misses one), so the draws were thrown away. They
    were most of a model's construction: SmolLM2's 120 projections' kaiming_uniform_ and the
    embedding's normal_ took 0.8-1.0 s of each engine's start (AVX2 EPYC)."""
    kinds = (torch.nn.Linear, torch.nn.Embedding)
    saved = {kind: kind.reset_parameters for kind in kinds}
    for kind in kinds:
        kind.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for kind, method in saved.items():
            kind.reset_parameters = method


def _release_freed_memory() -> None:
    """Hand the float weights that packing or quantizing freed back to the OS. glibc keeps
    freed chunks in its heap (the mmap threshold grows with the first large frees), so without
    this a quantized model's scheduler keeps the float model's footprint (int4 SmolLM2: 250
    against 115 MiB resident). Under a preloaded tcmalloc, its own release does the same."""
    malloc.release_free_memory()


class Sequence(Protocol):
    """What the runner reads of a request (core.request.Request is one): its tokens, how many
    already have KV, and where its KV lives. The runner never changes it."""

    prompt_ids: list[int]
    output_ids: list[int]
    draft_ids: list[int]  # speculative tokens after output_ids, verified this step
    num_computed: int
    block_table: list[int]
    lora_name: str | None  # the LoRA adapter it runs under (None: the base model)


class ModelRunner:
    def __init__(
        self,
        model_path: Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attention_backend: str = "auto",
        page_size: int = 16,
        max_total_tokens: int | None = None,
        mem_fraction_static: float = 0.9,
        cpu_memory_gib: float = 4.0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        quantization: str = "none",
        gguf_path: Path | None = None,
        draft: bool = False,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = pick_device(device)
        self._pick_dtypes(dtype)
        self.page_size = page_size
        self.is_draft = draft  # a speculative draft's: its proposer logs its KV cache
        self.backend = get_backend(attention_backend, self.device)
        self._load(model_path, max_model_len, quantization, gguf_path)
        self.num_blocks = self._size_pool(max_total_tokens, mem_fraction_static, cpu_memory_gib)
        self._allocate_kv()

    lora: LoraSet | None = None

    def enable_lora(self, paths: dict[str, Path], max_rank: int, max_per_batch: int) -> None:
        """Serve the PEFT adapters `paths` (name -> directory) beside the base. Each is read
        once now, so a bad directory fails at start-up naming the problem, then kept or
        evicted by the LoraSet. The factors stay float32 on the CPU whatever the projections
        run in (the low-rank product is small, and torch's bfloat16 matmuls of these shapes are
        10-40x slower than float32 on a CPU without AVX-512 BF16); bfloat16 on a GPU for a
        bfloat16 model."""
        dtype = (torch.bfloat16 if self.linear_dtype == torch.bfloat16
                 and self.device.type != "cpu" else torch.float32)
        self.lora = LoraSet(self.model, paths, max_rank, max_per_batch, dtype,
                            device=self.device)
        for name in paths:
            self.lora.get(name)

    def _pick_dtypes(self, dtype: str) -> None:
        """The activations', attention's and KV cache's dtype, and the projections' (they
        differ where a CPU lacks bfloat16 attention or bfloat16 matmuls; the log says so)."""
        self.dtype = pick_dtype(dtype, self.device)  # activations, attention, KV cache
        self.linear_dtype = self.dtype  # the projections' weights and matmuls
        if self.dtype == torch.bfloat16 and _cpu_bf16_linears(self.device):
            lacking = _cpu_bf16_attention_missing()
            if lacking:
                # bfloat16 still pays off in the projections (oneDNN's AVX512-BF16 kernels run
                # about 2x float32, half the bytes per step); attention in bfloat16 would run
                # the decode kernel's portable path or plain torch, slower than float32's
                log.info(f"{lacking}: --dtype bfloat16 runs the projections in bfloat16, "
                         "activations, attention and the KV cache in float32")
                self.dtype = torch.float32
        elif self.dtype == torch.bfloat16 and self.device.type == "cpu" and _onednn_enabled():
            # No oneDNN bfloat16 matmuls (AVX2): torch's generic bfloat16 F.linear runs 3-4x
            # float32's time (64 x 576 x 1,536 on an AVX2 EPYC: 15.6 against 4.2 ms). The
            # projections run oneDNN float32 from the bfloat16 weights instead, widened exactly:
            # bfloat16 inputs, float32 sums, a bfloat16 result, as a bfloat16 GEMM computes it.
            # Activations, attention and the KV cache stay bfloat16 (half the KV bytes).
            self.linear_dtype = torch.float32
            log.info("this CPU has no oneDNN bfloat16 matmuls (AVX512 BW/VL/DQ or "
                     "AVX-NE-CONVERT): --dtype bfloat16 runs the projections in float32 "
                     "from the bfloat16 weights (twice their bytes); activations, attention "
                     "and the KV cache in bfloat16")
        elif self.dtype == torch.bfloat16 and self.device.type == "cpu":
            # what was asked is kept (half the KV cache's bytes), but the user should know
            log.warning("TOKENLINE_ONEDNN=0: --dtype bfloat16 runs torch's generic bfloat16 "
                        "kernels, several times float32's time per step (a 64-row "
                        "projection: 3.7x on an AVX2 EPYC); --dtype float32 is faster")

    def _load(self, model_path: Path, max_model_len: int | None, quantization: str,
              gguf_path: Path | None) -> None:
        """The config, the weights, then quantized or (on CPU) packed projections."""
        self.config = c = json.loads((model_path / "config.json").read_text())
        family = model_class(c)  # refuses what the engine does not implement
        self.architecture = family.__name__
        self.max_model_len = max_model_len or int(c.get("max_position_embeddings", 2048))
        with torch.device(self.device), _parameters_left_uninitialized():
            model = family(c, self.backend, self.max_model_len)
        model.load_weights(model_path)
        self.model = model.to(self.dtype).eval()
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.linear_backend = "torch"
        self.quantization = self._quantize(quantization, gguf_path)
        if self.quantization is not None:
            # native_int8: our C++ kernels (float32 in and out); torch_int8: torch's (bfloat16)
            self.linear_backend = f"{self.quantization.kernel}_{quantization}"
            if self.device.type == "cpu":
                self.linear_dtype = quant.kernel_dtype()
        elif self.device.type == "cpu" and self.dtype == self.linear_dtype == torch.float32 and (
            self._float32_tiles()
        ):
            self.model.pack_for_cpu(torch.float32, tiles=True)
            self.linear_backend = "native_float32"
        elif self.device.type == "cpu" and _onednn_enabled() and (
            self.dtype in (torch.float32, torch.bfloat16)
        ):
            tiles = self.linear_dtype == torch.bfloat16 and self._bf16_tiles()
            self.model.pack_for_cpu(self.linear_dtype, tiles=tiles)
            self.linear_backend = "native_bfloat16" if tiles else "onednn"
        _release_freed_memory()
        self.num_layers = c["num_hidden_layers"]
        self.num_kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
        self.head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        self.vocab_size = c["vocab_size"]
        self.attention_kernel = self._pick_attention_kernel(c["num_attention_heads"])
        self.prefill_kernel = self._pick_prefill_kernel(c["num_attention_heads"])
        # what stays of the plain weights (on CPU the projections' were swapped for oneDNN
        # copies), and those copies
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.packed_bytes = self.model.packed_bytes()
        log.info(f"Weights: {(self.weight_bytes + self.packed_bytes) / (1 << 20):.0f} MiB, "
                 f"quantization {quantization}",
                 **(self.quantization.as_dict() if self.quantization else {}))

    def _float32_tiles(self) -> bool:
        """Whether the float32 projections run from our C++ tiles (quant.Float32Tiles) rather
        than oneDNN; where they cannot, the start-up log says why."""
        missing = quant.float32_tiles_missing(self.model.linear_widths())
        if missing:
            log.info(f"float32 projections not from our C++ tiles ({missing}): through "
                     f"{'oneDNN' if _onednn_enabled() else 'torch (TOKENLINE_ONEDNN=0)'}")
        return missing is None

    def _bf16_tiles(self) -> bool:
        """Whether bfloat16 projections of a few rows run from our C++ tiles (quant.Bf16Tiles,
        oneDNN's copy beside them for larger calls) rather than oneDNN alone; where they
        cannot, the start-up log says why."""
        missing = quant.bf16_tiles_missing(self.model.linear_widths())
        if missing:
            log.info(f"bfloat16 projections not from our C++ tiles ({missing}): through oneDNN")
        else:
            log.info(f"bfloat16 projections of up to {quant.BF16_TILE_ROWS} rows from our C++ "
                     f"tiles (VDPBF16PS), larger ones through oneDNN")
        return missing is None

    def _allocate_kv(self) -> None:
        """One K and one V tensor per layer, `num_blocks` pages of `page_size` slots each."""
        slots = self.num_blocks * self.page_size
        shape = (slots, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        self.kv_bytes = slots * self.kv_bytes_per_token
        if self.is_draft:
            return  # a speculative draft's (first_layers, core/draft.py): its proposer logs it
        # the C++ decode kernel's vector path (avx512_bf16, avx512, avx2 or portable): what
        # -march=native built for this CPU
        isa = cpu_kernels().isa() if self.attention_kernel == "native" else None
        ops = fused_ops(self.kv_caches[0][0])  # the norms', rotary's, activation's, argmax's
        log.info(f"KV cache: {slots} tokens in {self.num_blocks} blocks of {self.page_size} "
                 f"tokens, {self.kv_bytes / GiB:.2f} GiB", device=str(self.device),
                 dtype=str(self.dtype), linear_dtype=str(self.linear_dtype),
                 backend=self.backend.name, linear=self.linear_backend,
                 decode_attention=self.attention_kernel, decode_attention_isa=isa,
                 prefill_attention=self.prefill_kernel,
                 fused_ops_isa=ops.isa() if ops is not None else None)

    def first_layers(self, num_layers: int, max_total_tokens: int) -> ModelRunner:
        """A runner over this one's model (the same module objects: no weights copied) that
        computes only layers [0, num_layers), then the final norm and the lm_head, into a KV
        cache of its own for those layers (`max_total_tokens` of them): a self-speculative
        draft (core/draft.py). It shares the attention backend and the LoRA set too, which
        hold nothing across forwards but a step's plan and scratch buffers. (All the layers
        only for a quantized copy of the target: core/draft.py.)"""
        assert 1 <= num_layers <= self.num_layers, f"{num_layers} of {self.num_layers} layers"
        draft = copy.copy(self)
        draft.is_draft = True
        draft.num_layers = num_layers
        draft.num_blocks = max(1, -(-max_total_tokens // self.page_size))
        draft._allocate_kv()
        return draft

    def _quantize(self, mode: str, gguf_path: Path | None) -> quant.QuantSummary | None:
        """Quantize the loaded model's weights (`mode` int8 or int4), reading a GGUF's own int4
        blocks where they map exactly; on CUDA, dequantized on load (quant.py says why)."""
        if mode == "none":
            if gguf_path:
                log.info(f"{gguf_path.name}: weights run dequantized to {self.linear_dtype} "
                         "(--quantization int8 or int4 runs them quantized)")
            return None
        # the file's own Q8_0 (int8, and the embedding under int4) and 4-bit blocks (int4)
        gguf = quant.GGUFWeights(gguf_path, self.config) if gguf_path else None
        if gguf is not None:
            gguf.check(mode)
        return quantize_model(self.model, mode, gguf, packed=self.device.type == "cpu")

    def _pick_attention_kernel(self, num_heads: int) -> str:
        """On CPU in float32 or bfloat16, decodes go through the C++ kernel when it builds for
        this shape."""
        if not isinstance(self.backend, TorchBackend) or self.device.type != "cpu" or (
            self.dtype not in (torch.float32, torch.bfloat16)
        ):
            return self.backend.name
        kernels = cpu_kernels()
        group = num_heads // self.num_kv_heads
        self.backend.use_native = kernels is not None and kernels.supports(self.head_dim, group)
        if kernels is not None and not self.backend.use_native:
            log.info(f"the C++ decode kernel has no head_dim {self.head_dim} x group {group}: "
                     "decode attention runs in torch (SDPA)", architecture=self.architecture)
        return "native" if self.backend.use_native else "sdpa"

    def _pick_prefill_kernel(self, num_heads: int) -> str:
        """On CPU in float32 or bfloat16, prefill and extend chunks go through the C++ kernel
        when it builds for this shape (SDPA otherwise)."""
        if not isinstance(self.backend, TorchBackend) or self.device.type != "cpu" or (
            self.dtype not in (torch.float32, torch.bfloat16)
        ):
            return self.backend.name
        kernels = prefill_kernels().module
        group = num_heads // self.num_kv_heads
        self.backend.use_native_prefill = kernels is not None and kernels.supports(
            self.head_dim, group)
        if kernels is not None and not self.backend.use_native_prefill:
            log.info(f"the C++ prefill kernel has no head_dim {self.head_dim} x group {group}: "
                     "prefill attention runs in torch (SDPA)", architecture=self.architecture)
        if not self.backend.use_native_prefill:
            return "sdpa"
        self.backend.sdpa = _sdpa_route(self.dtype)
        if self.backend.sdpa is not None:
            return f"native+sdpa_from_{self.backend.sdpa.prompts_from}"
        return "native"

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (
            torch.finfo(self.dtype).bits // 8
        )

    def _size_pool(self, max_total_tokens: int | None, fraction: float, cpu_gib: float) -> int:
        if max_total_tokens:
            return max(1, -(-max_total_tokens // self.page_size))
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * fraction - (total - free)
        else:
            budget = cpu_gib * GiB * fraction - self.weight_bytes - self.packed_bytes
        # Activations of the largest step: a few hidden-size buffers per token, and vocab-size
        # ones per sampled row only (logits are computed for a step's last tokens; with
        # Gemma's 262k vocabulary, 4096 rows of them would be 4 GiB).
        activation = (4096 * self.config["hidden_size"] * 16 + 512 * self.vocab_size) * 4
        tokens = int((budget - activation) // self.kv_bytes_per_token)
        if tokens < self.page_size * 4:
            raise ValueError(
                f"no room for a KV cache: {budget / GiB:.2f} GiB left after weights; raise "
                "--mem-fraction-static / --cpu-memory-gib or set --max-total-tokens"
            )
        return tokens // self.page_size

    def info(self) -> dict:
        return {
            "kv_cache": {
                "num_tokens": self.num_blocks * self.page_size,
                "num_blocks": self.num_blocks,
                "page_size": self.page_size,
                "bytes": self.kv_bytes,
                "dtype": str(self.dtype).removeprefix("torch."),
            },
            "model_config": {
                "architecture": self.architecture,
                "num_hidden_layers": self.num_layers,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "hidden_size": self.config["hidden_size"],
                "num_parameters": self.num_parameters,
            },
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "linear_dtype": str(self.linear_dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "linear_backend": self.linear_backend,
            "quantization": self.quantization.as_dict() if self.quantization else {"mode": "none"},
            "weight_bytes": self.weight_bytes + self.packed_bytes,
            "decode_attention": self.attention_kernel,
            "prefill_attention": self.prefill_kernel,
        }

    @torch.inference_mode()
    def forward(self, reqs: list[Sequence], num_new: list[int], num_logits: list[int]):
        """Compute the new tokens of every request. Logits come back for the last
        `num_logits[b]` of request b's new tokens (0: none, a prefill chunk that does not end
        the prompt; 1: its next token; k + 1: a speculative verify; all of a chunk: its prompt
        logprobs), stacked in request order: [sum(num_logits), vocab]."""
        p = self.page_size
        ids: list[int] = []
        begins: list[int] = []
        seq_lens: list[int] = []
        for req, n in zip(reqs, num_new, strict=True):
            begin = req.num_computed
            ids += _token_slice(req, begin, begin + n)
            begins.append(begin)
            seq_lens.append(begin + n)
        width = max(len(r.block_table) for r in reqs)
        tables = np.zeros((len(reqs), width), dtype=np.int32)
        for b, req in enumerate(reqs):
            tables[b, : len(req.block_table)] = req.block_table
        counts = np.asarray(num_new, dtype=np.int64)
        starts = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # token t of row b sits at position begins[b] + (t - starts[b]), in that row's table
        row = np.repeat(np.arange(len(reqs)), counts)
        positions = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1] - begins, counts)
        slots = tables[row, positions // p].astype(np.int64) * p + positions % p
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_lens_cpu=list(num_new),
            seq_lens_cpu=seq_lens,
            page_size=p,
        )
        logits_idx = torch.from_numpy(_logit_rows(starts, num_logits)).to(dev)
        if self.lora is not None:
            self.lora.activate([r.lora_name for r in reqs], num_new)
        return self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.from_numpy(positions).to(dev),
            meta,
            self.kv_caches,
            logits_idx,
        )


def _logit_rows(starts: np.ndarray, num_logits: list[int]) -> np.ndarray:
    """The packed rows whose logits are wanted: the last num_logits[b] of request b's rows."""
    counts = np.asarray(num_logits, dtype=np.int64)
    ends = starts[1:]
    if not counts.any():
        return np.zeros(0, dtype=np.int64)
    if (counts <= 1).all():  # the common step: one row per sampling request
        return ends[counts == 1] - 1
    offsets = np.arange(int(counts.sum()), dtype=np.int64)
    firsts = np.cumsum(counts) - counts
    return np.repeat(ends - counts - firsts, counts) + offsets


def _token_slice(req: Sequence, begin: int, end: int) -> list[int]:
    """(prompt + output + drafts)[begin:end] without building the whole list."""
    n = len(req.prompt_ids)
    total = n + len(req.output_ids)
    if end > total:  # a verify (the last output token, then drafts), or a draft's own step
        head = _token_slice(req, begin, total) if begin < total else []
        return head + req.draft_ids[max(begin, total) - total: end - total]
    if begin >= n:
        return req.output_ids[begin - n : end - n]
    if end <= n:
        return req.prompt_ids[begin:end]
    return req.prompt_ids[begin:] + req.output_ids[: end - n]
