"""`tokenline bench quality`: what --quantization costs in accuracy, on a fixed text.

The text (bench/texts/declaration_gettysburg.txt: the Declaration of Independence and the
Gettysburg Address, public domain, 2,045 SmolLM2 tokens) is cut into windows of --context
tokens; every window runs as one fresh sequence through our engine's model runner, once per
--quantization. For each, as llama.cpp's `perplexity` tool reports for its types:

    perplexity   exp(mean -log p(next token)) over every position but each window's first
    mean KL      mean over those positions of KL(p_base || p_quant) of the next-token
                 distribution, against the first --quantization given (default: none, i.e.
                 float32)
    top-1        how often the most likely next token is the base's

    tokenline bench quality                              # none, int8, int4 on SmolLM2
    tokenline bench quality --quantization none int4 --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/offline.py

import torch  # noqa: E402

DEFAULT_TEXT = Path(__file__).parent / "texts" / "declaration_gettysburg.txt"


@dataclass
class Quality:
    quantization: str
    dtype: str
    weight_mib: float
    tokens: int  # positions scored
    perplexity: float
    mean_kl: float  # against the base
    top1_agreement: float


def window_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one fresh sequence, in one prefill through the paged cache."""
    from services.scheduler.attention.base import AttentionMetadata

    n, p = len(ids), runner.page_size
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(-(-n // p), dtype=torch.int32)[None],
        slot_mapping=torch.arange(n),
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        page_size=p,
    )
    with torch.inference_mode():
        return runner.model(torch.tensor(ids), torch.arange(n), meta, runner.kv_caches,
                            torch.arange(n)).float()


def measure(quantizations: list[str], *, model: str | None = None, dtype: str = "float32",
            text: Path = DEFAULT_TEXT, context: int = 512,
            max_tokens: int | None = None) -> list[Quality]:
    """One model runner per quantization, all fed the same windows; the first is the base."""
    from tokenizers import Tokenizer

    from common.modelstore import gguf_source, prepare_model
    from services.scheduler.executor.model_runner import ModelRunner

    path = prepare_model(model)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text.read_text()).ids
    ids = ids[:max_tokens] if max_tokens else ids
    runners = [ModelRunner(path, device="cpu", dtype=dtype, quantization=q,
                           gguf_path=gguf_source(model), max_total_tokens=context)
               for q in quantizations]
    nll = [0.0] * len(runners)
    kl = [0.0] * len(runners)
    agree = [0] * len(runners)
    scored = 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        targets = torch.tensor(window[1:])
        base = None
        for i, runner in enumerate(runners):
            logp = window_logits(runner, window)[:-1].log_softmax(-1)
            nll[i] += -logp.gather(1, targets[:, None]).sum().item()
            if base is None:
                base = logp
            kl[i] += (base.exp() * (base - logp)).sum().item()
            agree[i] += (logp.argmax(-1) == base.argmax(-1)).sum().item()
        scored += len(window) - 1
    return [Quality(q, dtype, round((r.weight_bytes + r.packed_bytes) / (1 << 20), 1), scored,
                    math.exp(nll[i] / scored), kl[i] / scored, agree[i] / scored)
            for i, (q, r) in enumerate(zip(quantizations, runners, strict=True))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenline bench quality",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", help="transformers directory or GGUF (default SmolLM2)")
    p.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"],
                   choices=["none", "int8", "int4"], help="the first is the KL base")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(args.quantization, model=args.model, dtype=args.dtype, text=args.text,
                      context=args.context)
    print(f"{results[0].tokens} tokens scored, {args.text.name}, windows of {args.context}, "
          f"KL against {results[0].quantization} ({args.dtype})")
    print(f"{'quantization':<14}{'weights MiB':>12}{'perplexity':>12}{'mean KL':>12}{'top-1':>9}")
    for r in results:
        print(f"{r.quantization:<14}{r.weight_mib:>12.1f}{r.perplexity:>12.4f}"
              f"{r.mean_kl:>12.5f}{r.top1_agreement:>9.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
