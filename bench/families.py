"""Tiny random-weight models of every family, and the cost of each family's extras.

`make_tiny(family, dir)` writes a transformers checkpoint of that family (config from its own
transformers config class, random weights far from ties, SmolLM2's tokenizer): the tests check
our forward against transformers' on these. `python -m bench.families` times one request's
decode step for each, against the Llama of the same size, in one process, interleaved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# as in bench/offline.py: spinning OpenMP waiters stall on a shared machine (read at torch load)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Same size for all: 4 layers, 4 query heads over 2 KV heads of 32 dims, hidden 128; windows
# of 8 tokens where the family has sliding layers (so a few decode steps go past them).
BASE = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
WINDOW = 8
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # name: (transformers config class, model class, overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "sliding_attention"])),
}


def make_tiny(family: str, target: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:  # norms and biases away from their 1 / 0 starts: their layout shows
                p.add_(torch.randn_like(p) * 0.1)
    return save_with_tokenizer(model, target, tokenizer_from)


def save_with_tokenizer(model, target: Path, tokenizer_from: Path) -> Path:
    """Save a random-weight model with another model's tokenizer files beside it."""
    model.save_pretrained(target, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, target / name)
    return target


class DecodeProbe:
    """One request at `context` tokens in a ModelRunner, stepped one decode at a time."""

    def __init__(self, path: Path, context: int, steps: int) -> None:
        from common.messages import SamplingParams
        from services.scheduler.core.request import Request
        from services.scheduler.executor.model_runner import ModelRunner

        self.runner = ModelRunner(path, device="cpu", dtype="float32",
                                  max_total_tokens=context + steps + 64)
        self.req = Request(rid="r", prompt_ids=list(range(1000, 1000 + context)),
                           params=SamplingParams())
        self.req.block_table = list(range(self.runner.num_blocks))
        self.runner.forward([self.req], [context], [1])
        self.req.num_computed = context
        self.times: list[float] = []

    def step(self) -> None:
        self.req.output_ids.append(1234)
        t0 = time.perf_counter()
        self.runner.forward([self.req], [1], [1])
        self.times.append(time.perf_counter() - t0)
        self.req.num_computed += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    from common.modelstore import prepare_model

    smol = prepare_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        probes = {f: DecodeProbe(make_tiny(f, Path(tmp) / f, smol), args.context, args.steps)
                  for f in FAMILIES}
        # round-robin, one step of each family per round: a shared machine's load drifts
        # over a run, and then weighs on every family alike
        for _ in range(args.steps):
            for probe in probes.values():
                probe.step()
    base = probes["llama"].times
    print(f"one request's decode step at context {args.context}, {args.steps} steps each, the "
          "families interleaved: min and median (ms), and each as a ratio to Llama's")
    for family, probe in probes.items():
        best, mid = min(probe.times), statistics.median(probe.times)
        print(f"  {family:8s} min {best * 1e3:7.3f} ({best / min(base):4.2f}x)   "
              f"median {mid * 1e3:7.3f} ({mid / statistics.median(base):4.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
