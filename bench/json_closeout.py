"""Constrained JSON that always closes: many sampled requests over the ten unbounded nested
schemas (tests/data/json_schemas.py's NESTED_SCHEMAS), all in one offline engine.

Counts the replies that parse and validate, those cut by the budget, and those refused because
their max_tokens is below the schema's shortest document (a 400 naming max_tokens); and what
a step's grammar work costs: filling and applying the bitmasks (`mask_s`) and the close-out
(`closeout.py`), per constrained row.

    .venv/bin/python -m bench.json_closeout --requests 500
    .venv/bin/python -m bench.json_closeout --requests 100 --no-closeout   # before: cut replies
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import jsonschema

from common.messages import SamplingParams, StructuredOutputs
from tests.data.json_schemas import NESTED_SCHEMAS

BUDGETS = (16, 24, 32, 48, 64, 96, 128, 192)


@dataclass
class Costs:
    steps: int = 0
    masked_rows: int = 0
    mask_s: float = 0.0
    closeout_s: float = 0.0
    closeout_calls: int = 0
    outcomes: Counter = field(default_factory=Counter)


def requests(n: int, seed: int = 0) -> tuple[list[list[dict]], list[SamplingParams]]:
    rng = random.Random(seed)
    convs, params = [], []
    for i in range(n):
        prompt, schema = NESTED_SCHEMAS[i % len(NESTED_SCHEMAS)]
        convs.append([{"role": "user", "content": f"{prompt} Reply in JSON."}])
        params.append(SamplingParams(
            max_new_tokens=rng.choice(BUDGETS), temperature=round(rng.uniform(0.7, 1.0), 2),
            seed=i, structured_outputs=StructuredOutputs(json=schema,
                                                         param="response_format")))
    return convs, params


def outcome(out, params: SamplingParams) -> str:
    """valid | refused (budget below the schema's minimum) | cut | invalid"""
    if out.finish_reason == "error":
        return "refused" if "max_tokens" in (out.error or "") else "error"
    if out.finish_reason == "length":
        return "cut"
    try:
        jsonschema.validate(json.loads(out.text), params.structured_outputs.json)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def instrument(core, costs: Costs) -> None:
    """Count each step's mask time and time the close-out's calls."""
    step = core.step

    def timed_step():
        outs = step()
        costs.steps += 1
        costs.masked_rows += core.last_step.num_masked
        costs.mask_s += core.last_step.mask_s
        return outs

    def timed_choose(*args):
        t0 = time.perf_counter()
        try:
            return choose(*args)
        finally:
            costs.closeout_s += time.perf_counter() - t0
            costs.closeout_calls += 1

    core.step = timed_step
    if core.closer is not None:
        choose = core.closer.choose
        core.closer.choose = timed_choose


def run(engine, n: int, seed: int = 0) -> Costs:
    convs, params = requests(n, seed)
    costs = Costs()
    instrument(engine.core, costs)
    outs = engine.chat(convs, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        costs.outcomes[outcome(out, p)] += 1
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--no-closeout", action="store_true",
                    help="without the close-out: what a reply cut by max_tokens looked like")
    args = ap.parse_args()
    from tokenline import Engine

    engine = Engine(max_total_tokens=60000, max_running_requests=args.max_running_requests)
    if args.no_closeout:
        engine.core.closer = None
    t0 = time.perf_counter()
    c = run(engine, args.requests, args.seed)
    wall = time.perf_counter() - t0
    rows = max(c.masked_rows, 1)
    print(json.dumps({
        "requests": args.requests, "outcomes": dict(c.outcomes), "wall_s": round(wall, 1),
        "steps": c.steps, "masked_rows": c.masked_rows,
        "mask_us_per_row": round(1e6 * c.mask_s / rows, 1),
        "closeout_us_per_row": round(1e6 * c.closeout_s / rows, 1),
        "closeout_calls": c.closeout_calls}, indent=1))


if __name__ == "__main__":
    main()
