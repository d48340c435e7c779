"""Batching simulator: why continuous batching wins, in slot-steps.

A discrete simulation with one step per decode token. Each request needs `length` decode
steps; a batch has `max_batch` slots. The three policies differ only in when a request may
take a slot:

    static      fill a batch of max_batch, run it until its longest member is done;
                everyone is answered then, and nothing new joins meanwhile
    dynamic     as static, but a partial batch starts once its oldest waiter has waited
                `batch_wait_steps` (Triton-style max queue delay)
    continuous  (Orca) a slot freed at step t is refilled at step t+1

With `kv_tokens` the KV held by the running set (prompt + generated so far) is capped: a
step that would overflow retracts the running request with the fewest generated tokens
(SGLang's order, longest prompt on ties) to the front of the queue; it keeps its tokens and
recomputes its KV when readmitted.

Run: tokenline simulate --policy static,continuous --max-batch 4 --lengths 8,4,3,10,2,5,7,1
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Literal

Policy = Literal["static", "dynamic", "continuous"]
POLICIES: tuple[Policy, ...] = ("static", "dynamic", "continuous")
TEXTBOOK_LENGTHS = [8, 4, 3, 10, 2, 5, 7, 1]


@dataclass
class SimRequest:
    rid: int
    length: int
    prompt: int
    arrival: int
    generated: int = 0
    finish: int = 0

    def kv_after_step(self) -> int:
        """KV tokens this request holds once the coming step has written its token."""
        return self.prompt + self.generated + 1


@dataclass
class SimResult:
    policy: Policy
    max_batch: int
    makespan: int
    slot_steps: int  # slots the policy held: a whole batch for static, one per decode else
    occupied_slot_steps: int  # slots holding a request, done-but-waiting ones included
    useful_tokens: int
    finish_steps: list[int]
    generated: list[int]
    retractions: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    prefill_slots: int = 0  # prompt positions computed, padding included
    kv_tokens: int | None = None

    @property
    def wasted_slot_steps(self) -> int:
        return self.slot_steps - self.useful_tokens

    @property
    def wasted_fraction(self) -> float:
        return self.wasted_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.useful_tokens / self.makespan if self.makespan else 0.0

    @property
    def raw_occupancy(self) -> float:
        total = self.max_batch * self.makespan
        return self.occupied_slot_steps / total if total else 0.0

    @property
    def slot_efficiency(self) -> float:
        return self.useful_tokens / self.slot_steps if self.slot_steps else 0.0

    @property
    def prefill_padding(self) -> int:
        return self.prefill_slots - self.prompt_tokens

    @property
    def prefill_padding_fraction(self) -> float:
        return self.prefill_padding / self.prefill_slots if self.prefill_slots else 0.0

    def to_dict(self) -> dict[str, object]:
        derived = (
            "wasted_slot_steps", "wasted_fraction", "tokens_per_step", "raw_occupancy",
            "slot_efficiency", "prefill_padding", "prefill_padding_fraction",
        )
        return asdict(self) | {name: getattr(self, name) for name in derived}


@dataclass
class _Sim:
    policy: Policy
    max_batch: int
    kv_tokens: int | None
    batch_wait_steps: int
    pending: deque[SimRequest]  # not arrived yet, in arrival order
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)  # decoding this step
    batch: list[SimRequest] = field(default_factory=list)  # static/dynamic slot holders
    step: int = 0
    slot_steps: int = 0
    occupied: int = 0
    retractions: int = 0
    recomputed: int = 0
    prompt_tokens: int = 0
    prefill_slots: int = 0
    unfinished: int = 0

    def run(self) -> None:
        while self.unfinished:
            self.step += 1
            self.arrive()
            self.retract()
            self.admit()
            self.decode()

    def arrive(self) -> None:
        # A request arriving at step a can decode from step a + 1; default arrival 0.
        while self.pending and self.pending[0].arrival < self.step:
            self.waiting.append(self.pending.popleft())

    def kv_after_step(self) -> int:
        return sum(r.kv_after_step() for r in self.running)

    def retract(self) -> None:
        while self.kv_tokens is not None and self.kv_after_step() > self.kv_tokens:
            victim = min(self.running, key=lambda r: (r.generated, -r.prompt, -r.rid))
            self.running.remove(victim)
            if victim in self.batch:
                self.batch.remove(victim)
            self.waiting.appendleft(victim)
            self.retractions += 1

    def admit(self) -> None:
        if self.policy == "continuous":
            admitted = self.take(self.max_batch - len(self.running))
            self.prefill_slots += sum(r.prompt + r.generated for r in admitted)
        elif not self.running and self.batch_ready():
            admitted = self.take(self.max_batch)
            # A static batch is one [members, longest prompt] tensor: short prompts are padded.
            self.prefill_slots += len(admitted) * max((r.prompt + r.generated for r in admitted),
                                                      default=0)
            self.batch = list(admitted)
        else:
            return
        self.running += admitted
        self.prompt_tokens += sum(r.prompt + r.generated for r in admitted)
        self.recomputed += sum(r.generated for r in admitted)

    def batch_ready(self) -> bool:
        if not self.waiting:
            return False
        if len(self.waiting) >= self.max_batch or not self.pending:
            return True
        if self.policy == "dynamic":
            oldest_waited = self.step - 1 - min(r.arrival for r in self.waiting)
            return oldest_waited >= self.batch_wait_steps
        return False

    def take(self, free_slots: int) -> list[SimRequest]:
        admitted: list[SimRequest] = []
        kv_free = float("inf") if self.kv_tokens is None else self.kv_tokens - self.kv_after_step()
        # First come, first served: a head that does not fit blocks the queue.
        while self.waiting and len(admitted) < free_slots:
            if self.waiting[0].kv_after_step() > kv_free:
                break
            admitted.append(self.waiting.popleft())
            kv_free -= admitted[-1].kv_after_step()
        return admitted

    def decode(self) -> None:
        if self.policy == "continuous":
            self.slot_steps += len(self.running)
            self.occupied += len(self.running)
        elif self.batch:
            self.slot_steps += self.max_batch
            self.occupied += len(self.batch)
        for req in self.running:
            req.generated += 1
        done = [r for r in self.running if r.generated == r.length]
        self.running = [r for r in self.running if r.generated < r.length]
        if self.policy == "continuous":
            self.finish(done)
        elif self.batch and not self.running:
            self.finish(self.batch)  # a static batch answers everyone at once
            self.batch = []

    def finish(self, reqs: list[SimRequest]) -> None:
        for req in reqs:
            req.finish = self.step
        self.unfinished -= len(reqs)


def simulate(
    policy: Policy,
    max_batch: int,
    lengths: list[int],
    prompt_lengths: list[int] | None = None,
    kv_tokens: int | None = None,
    arrivals: list[int] | None = None,
    batch_wait_steps: int = 0,
) -> SimResult:
    """Simulate one policy; every request decodes exactly `lengths[i]` tokens."""
    prompts = prompt_lengths or [0] * len(lengths)
    arrive_at = arrivals or [0] * len(lengths)
    _validate(policy, max_batch, lengths, prompts, arrive_at, kv_tokens)
    reqs = [
        SimRequest(i, n, p, a)
        for i, (n, p, a) in enumerate(zip(lengths, prompts, arrive_at, strict=True))
    ]
    sim = _Sim(policy, max_batch, kv_tokens, batch_wait_steps,
               deque(sorted(reqs, key=lambda r: r.arrival)), unfinished=len(reqs))
    sim.run()
    return SimResult(
        policy=policy,
        max_batch=max_batch,
        makespan=max((r.finish for r in reqs), default=0),
        slot_steps=sim.slot_steps,
        occupied_slot_steps=sim.occupied,
        useful_tokens=sum(r.generated for r in reqs),
        finish_steps=[r.finish for r in reqs],
        generated=[r.generated for r in reqs],
        retractions=sim.retractions,
        recomputed_tokens=sim.recomputed,
        prompt_tokens=sim.prompt_tokens,
        prefill_slots=sim.prefill_slots,
        kv_tokens=kv_tokens,
    )


def _validate(policy: str, max_batch: int, lengths: list[int], prompts: list[int],
              arrivals: list[int], kv_tokens: int | None) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if len(prompts) != len(lengths) or len(arrivals) != len(lengths):
        raise ValueError("prompt_lengths and arrivals need one entry per request")
    if any(n < 1 for n in lengths) or any(p < 0 for p in prompts) or any(a < 0 for a in arrivals):
        raise ValueError("lengths must be >= 1, prompt lengths and arrivals >= 0")
    # A request that cannot fit alone would be retracted forever.
    too_big = [p + n for p, n in zip(prompts, lengths, strict=True) if p + n > (kv_tokens or 0)]
    if kv_tokens is not None and too_big:
        raise ValueError("kv_tokens is smaller than some request's prompt + length")


def format_result(res: SimResult) -> str:
    finish = " ".join(f"r{i}={s}" for i, s in enumerate(res.finish_steps))
    lines = [
        f"policy {res.policy}  max_batch {res.max_batch}  requests {len(res.finish_steps)}",
        f"  makespan            {res.makespan} steps",
        f"  slot-steps          {res.slot_steps}",
        f"  wasted slot-steps   {res.wasted_slot_steps} ({res.wasted_fraction:.1%})",
        f"  useful tokens       {res.useful_tokens}",
        f"  tokens per step     {res.tokens_per_step:.3f}",
        f"  raw occupancy       {res.raw_occupancy:.1%}",
        f"  slot efficiency     {res.slot_efficiency:.1%}",
        f"  finish step         {finish}",
    ]
    if res.kv_tokens is not None:
        lines.append(f"  retractions         {res.retractions} "
                     f"({res.recomputed_tokens} generated tokens recomputed)")
    if res.prompt_tokens:
        lines.append(f"  prefill padding     {res.prefill_slots} slots for {res.prompt_tokens} "
                     f"real tokens, {res.prefill_padding} wasted "
                     f"({res.prefill_padding_fraction:.1%})")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from e


def _policies(text: str) -> list[Policy]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return names  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenline simulate", description=__doc__.split("\n")[0])
    p.add_argument("--policy", type=_policies, default=list(POLICIES),
                   help="static, dynamic, continuous, or a comma list to compare (default: all)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--lengths", type=_ints, default=None,
                   help="decode tokens per request (default: 8,4,3,10,2,5,7,1, or 1 per "
                        "prompt when only --prompt-lengths is given)")
    p.add_argument("--prompt-lengths", type=_ints, default=None, help="prompt tokens per request")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool size in tokens; overflowing steps retract a request")
    p.add_argument("--arrivals", type=_ints, default=None,
                   help="arrival step per request (default: all at 0)")
    p.add_argument("--batch-wait-steps", type=int, default=0,
                   help="dynamic: start a partial batch once its oldest waiter waited this long")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    lengths = args.lengths
    if lengths is None:
        lengths = [1] * len(args.prompt_lengths) if args.prompt_lengths else TEXTBOOK_LENGTHS
    try:
        results = [
            simulate(policy, args.max_batch, lengths, args.prompt_lengths, args.kv_tokens,
                     args.arrivals, args.batch_wait_steps)
            for policy in args.policy
        ]
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print("\n\n".join(format_result(r) for r in results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
