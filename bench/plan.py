"""Memory planner: how many tokens and sequences fit, and is decode memory-bound?

    KV pool  = GPU memory x utilization - weights - overhead (activations, CUDA graphs, ...)
    KV/token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    tokens   = KV pool / (KV/token)          sequences = tokens // max_model_len
    training = 16 bytes per parameter (bf16 weights and grads, fp32 master copy and Adam m, v)
    decode arithmetic intensity = 2 x params x batch FLOPs / weight bytes (each weight is read
    once per step and used by every sequence), against the ridge = peak FLOP/s / bandwidth

Run: tokenline plan --preset llama-3-8b --gpu h100-80gb
     tokenline plan --model PATH --url http://localhost:8000   (compare with a running server)
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1024**3
KiB = 1024
TRAIN_BYTES_PER_PARAM = 16

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8": 1, "int8": 1,
}


@dataclass(frozen=True)
class Gpu:
    memory_gib: float  # what the driver reports as usable
    peak_tflops: float  # dense bf16
    bandwidth_tbs: float


GPUS = {
    "h100-80gb": Gpu(79.65, 989.0, 3.35),
    "h200": Gpu(139.7, 989.0, 4.8),
}


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    max_model_len: int = 0
    dtype: str = "bfloat16"
    name: str = ""


PRESETS = {
    "llama-3-8b": ModelShape(8.03e9, 32, 8, 128, 4096, 8192, "bfloat16", "Llama-3-8B"),
}


@dataclass
class PlanResult:
    weight_bytes: float
    kv_bytes_per_token: int
    kv_pool_bytes: float
    token_capacity: int
    max_model_len: int
    max_sequences: int
    train_bytes: float
    batch: int
    arithmetic_intensity: float  # FLOPs per byte moved in one decode step
    ridge_point: float  # FLOPs per byte at which compute and bandwidth balance

    @property
    def memory_bound(self) -> bool:
        return self.arithmetic_intensity < self.ridge_point


# Bytes per weight under --quantization, as tokenline's CPU kernels hold them: codes of 8 or 4
# bits with a float16 scale and minimum per 32 weights (services/scheduler/models/quant.py; Q4_K
# files keep float32 ones, 0.75 a weight). The embedding is int8 under both. On CUDA tokenline
# dequantizes on load: plan that with none.
QUANT_BYTES = {"int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}


def weight_bytes_per_param(dtype: str, quantization: str) -> float:
    if quantization == "none":
        return dtype_bytes(dtype)
    if quantization not in QUANT_BYTES:
        raise ValueError(f"unknown quantization {quantization!r}; known: none, "
                         + ", ".join(QUANT_BYTES))
    return QUANT_BYTES[quantization]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def plan(
    model: ModelShape,
    gpu: Gpu,
    gpu_memory_utilization: float = 0.92,
    overhead_gib: float = 6.0,
    dtype: str | None = None,
    max_model_len: int | None = None,
    include_kv_bytes: bool = False,
    quantization: str = "none",
) -> PlanResult:
    """Plan the KV pool of one GPU for `model`; weights and KV both use `dtype`, the weights
    `quantization`'s bytes where one is given."""
    nbytes = dtype_bytes(dtype or model.dtype)
    weights = model.params * weight_bytes_per_param(dtype or model.dtype, quantization)
    per_token = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, nbytes)
    pool = max(0.0, gpu.memory_gib * GiB * gpu_memory_utilization - weights - overhead_gib * GiB)
    tokens = int(pool // per_token)
    context = max_model_len or model.max_model_len
    if context <= 0:
        raise ValueError("max_model_len is unknown: pass --max-model-len")
    batch = tokens // context
    # Each decode step reads every weight once for the whole batch (2 FLOPs per weight per
    # sequence); reading the batch's KV too only lowers the intensity further.
    moved = weights + (batch * context * per_token if include_kv_bytes else 0)
    return PlanResult(
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_pool_bytes=pool,
        token_capacity=tokens,
        max_model_len=context,
        max_sequences=batch,
        train_bytes=model.params * TRAIN_BYTES_PER_PARAM,
        batch=batch,
        arithmetic_intensity=2 * model.params * batch / moved if moved else 0.0,
        ridge_point=gpu.peak_tflops / gpu.bandwidth_tbs,
    )


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError as e:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from e


def count_params(cfg: dict) -> float:
    """Parameters of a Llama-family decoder, from its transformers config."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab, inter = cfg["vocab_size"], cfg["intermediate_size"]
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o and k, v
    per_layer = attn + 3 * hidden * inter + 2 * hidden  # SwiGLU MLP, two RMSNorms
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embeddings + hidden)


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    heads = cfg["num_attention_heads"]
    return ModelShape(
        params=float(cfg.get("num_parameters") or count_params(cfg)),
        layers=cfg["num_hidden_layers"],
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        hidden=cfg["hidden_size"],
        max_model_len=cfg.get("max_position_embeddings", 0),
        dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
        name=name,
    )


def shape_from_gguf(path: Path) -> ModelShape:
    """Shape from GGUF metadata; weights are counted unquantized, as transformers loads them."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    return ModelShape(
        params=float(sum(int(t.n_elements) for t in reader.tensors)),
        layers=int(field(f"{arch}.block_count")),
        kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        hidden=hidden,
        max_model_len=int(field(f"{arch}.context_length", 0)),
        name=str(field("general.name", path.name)),
    )


def load_shape(model: str) -> ModelShape:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf":
        return shape_from_gguf(path)
    return shape_from_config(json.loads(path.read_text()), name=str(model))


def get_server_info(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/get_server_info", timeout=timeout) as resp:
        return json.load(resp)


@dataclass
class ServerCheck:
    predicted_kv_bytes_per_token: int
    server_kv_bytes_per_token: float
    server_num_tokens: int
    implied_token_capacity: int

    @property
    def matches(self) -> bool:
        return abs(self.server_kv_bytes_per_token - self.predicted_kv_bytes_per_token) < 0.5


def check_server(info: dict, model: ModelShape | None) -> ServerCheck:
    """Predicted KV bytes per token against what the server's pool really spends."""
    kv, mc = info["kv_cache"], info["model_config"]
    if model is None:
        model = ModelShape(mc["num_parameters"], mc["num_hidden_layers"],
                           mc["num_key_value_heads"], mc["head_dim"], mc["hidden_size"])
    # Predict in the pool's own dtype: a float32 CPU pool is not a planner error.
    predicted = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim,
                                   dtype_bytes(kv["dtype"]))
    return ServerCheck(
        predicted_kv_bytes_per_token=predicted,
        server_kv_bytes_per_token=kv["bytes"] / kv["num_tokens"],
        server_num_tokens=kv["num_tokens"],
        implied_token_capacity=int(kv["bytes"] // predicted),
    )


def format_server(info: dict, check: ServerCheck) -> str:
    kv = info["kv_cache"]
    ratio = check.server_kv_bytes_per_token / check.predicted_kv_bytes_per_token
    verdict = "matches" if check.matches else f"off by {ratio:.3f}x"
    return "\n".join([
        f"server {info.get('model', '?')}  max_model_len {info.get('max_model_len', '?')}",
        f"  KV pool             {kv['bytes'] / GiB:.3f} GiB, {kv['num_tokens']:,} tokens in "
        f"{kv['num_blocks']:,} blocks of {kv['page_size']} ({kv['dtype']})",
        *([f"  weights             {info['weight_bytes'] / GiB:.3f} GiB resident, "
           f"quantization {info.get('quantization', {}).get('mode', 'none')}"]
          if "weight_bytes" in info else []),
        f"  KV per token        predicted {check.predicted_kv_bytes_per_token:,} B, "
        f"server {check.server_kv_bytes_per_token:,.1f} B ({verdict})",
        f"  implied capacity    {check.implied_token_capacity:,} tokens "
        f"(server reports {check.server_num_tokens:,})",
    ])


def format_plan(res: PlanResult, model: ModelShape, gpu: Gpu, gpu_name: str) -> str:
    bound = "memory-bound" if res.memory_bound else "compute-bound"
    return "\n".join([
        f"model {model.name or '?'}  {model.params / 1e9:.2f}B params  {model.layers} layers  "
        f"{model.kv_heads} KV heads x {model.head_dim}",
        f"gpu {gpu_name}  {gpu.memory_gib} GiB  {gpu.peak_tflops:g} TFLOP/s  "
        f"{gpu.bandwidth_tbs:g} TB/s",
        f"  weights             {res.weight_bytes / GiB:.2f} GiB",
        f"  KV per token        {res.kv_bytes_per_token / KiB:g} KiB",
        f"  KV pool             {res.kv_pool_bytes / GiB:.1f} GiB",
        f"  token capacity      {res.token_capacity:,} tokens (~{_short(res.token_capacity)})",
        f"  concurrency         {res.max_sequences} sequences at {res.max_model_len:,} tokens",
        f"  training memory     {res.train_bytes / 1e9:.3g} GB "
        f"({TRAIN_BYTES_PER_PARAM} B/param, mixed-precision Adam)",
        f"  decode intensity    {res.arithmetic_intensity:.1f} FLOP/byte at batch {res.batch}",
        f"  ridge point         {res.ridge_point:.0f} FLOP/byte ({bound})",
    ])


def _short(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenline plan", description=__doc__.split("\n")[0])
    src = p.add_argument_group("model (one of)")
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--config", help="a transformers config.json")
    src.add_argument("--model", help="a local model directory with config.json, or a GGUF file")
    src.add_argument("--params", type=float, help="parameter count, e.g. 8.03e9")
    src.add_argument("--layers", type=int)
    src.add_argument("--kv-heads", type=int)
    src.add_argument("--head-dim", type=int)
    src.add_argument("--hidden", type=int)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100-80gb")
    p.add_argument("--gpu-memory-gib", type=float, help="overrides the --gpu preset")
    p.add_argument("--peak-tflops", type=float, help="overrides the --gpu preset")
    p.add_argument("--bandwidth-tbs", type=float, help="overrides the --gpu preset")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--overhead-gib", type=float, default=6.0,
                   help="activations, CUDA graphs and allocator slack (default 6)")
    p.add_argument("--dtype", help="weights and KV dtype (default: the model's, else bf16)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weights at tokenline's int8 (1 B) or int4 (0.625 B) per parameter")
    p.add_argument("--max-model-len", type=int, help="context per sequence (default: model's)")
    p.add_argument("--include-kv-bytes", action="store_true",
                   help="count the batch's KV reads in the decode intensity, not weights only")
    p.add_argument("--url", help="compare with a running server's pool (GET /get_server_info)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def _shape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape | None:
    if args.preset:
        return PRESETS[args.preset]
    if args.config or args.model:
        return load_shape(args.config or args.model)
    flags = (args.params, args.layers, args.kv_heads, args.head_dim)
    if all(v is not None for v in flags):
        return ModelShape(args.params, args.layers, args.kv_heads, args.head_dim,
                          args.hidden or args.kv_heads * args.head_dim)
    if any(v is not None for v in flags):
        parser.error("--params, --layers, --kv-heads and --head-dim go together")
    if not args.url:
        parser.error("give --preset, --config, --model, the shape flags, or --url")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = _shape(args, parser)
    out: list[str] = []
    payload: dict[str, object] = {}
    if model is not None:
        base = GPUS[args.gpu]
        gpu = Gpu(args.gpu_memory_gib or base.memory_gib, args.peak_tflops or base.peak_tflops,
                  args.bandwidth_tbs or base.bandwidth_tbs)
        try:
            res = plan(model, gpu, args.gpu_memory_utilization, args.overhead_gib, args.dtype,
                       args.max_model_len, args.include_kv_bytes, args.quantization)
        except ValueError as e:
            parser.error(str(e))
        out.append(format_plan(res, model, gpu, args.gpu))
        payload["plan"] = asdict(res) | {"memory_bound": res.memory_bound}
    if args.url:
        try:
            info = get_server_info(args.url)
        except OSError as e:
            print(f"tokenline plan: cannot reach {args.url}: {e}")
            return 1
        check = check_server(info, model)
        out.append(format_server(info, check))
        payload["server"] = info | {"check": asdict(check) | {"matches": check.matches}}
    print(json.dumps(payload, indent=2) if args.json else "\n\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
