"""Sampler time per decode step at batch 64 against the forward time, in one run.

    python -m bench.sampler_cost [--batch 64] [--steps 30]

Three batches of the same shape: all greedy (the fast path), all sampled (temperature, top-p,
top-k, seed), and sampled with penalties and logprobs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from common.config import ServerArgs
from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore

MIXES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_p=0.9, top_k=50),
    "penalties+logprobs": dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.1, logprobs=5),
    # a nucleus wider than 1,024 candidates (flat rows) costs a full-vocabulary sort
    "penalties+top-p (flat)": dict(temperature=0.9, top_p=0.9, presence_penalty=0.5,
                                   frequency_penalty=0.3, repetition_penalty=1.1, logprobs=5),
}


def run(engine: EngineCore, batch: int, steps: int, params: dict) -> tuple[float, float]:
    rng = random.Random(0)
    for i in range(batch):
        engine.submit(TokenizedReq(
            rid=f"{len(engine.requests)}-{i}-{rng.random()}", gateway_id="g",
            input_ids=[rng.randrange(1000, 40000) for _ in range(128)],
            params=SamplingParams(max_new_tokens=steps + 4, ignore_eos=True, seed=i, **params)))
    fwd, smp = [], []
    while engine.has_work():
        engine.step()
        s = engine.last_step
        if s.num_decode == batch and not s.num_prefill_tokens:
            fwd.append(s.forward_s)
            smp.append(s.sample_s)
    return statistics.median(fwd), statistics.median(smp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler_cost")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    engine = EngineCore(ServerArgs(model=args.model, max_total_tokens=65536))
    print(f"batch {args.batch}, median over decode steps")
    print(f"{'mix':22} {'forward ms':>11} {'sampler ms':>11} {'sampler/forward':>16}")
    for name, params in MIXES.items():
        fwd, smp = run(engine, args.batch, args.steps, params)
        print(f"{name:22} {fwd * 1e3:11.1f} {smp * 1e3:11.1f} {smp / fwd:16.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
