"""The batched sampler on crafted logits: each parameter does what its definition says."""

from __future__ import annotations

import math

import torch

from common.messages import SamplingParams
from services.scheduler.core.sampler import SampleRow, apply_penalties, sample

V = 8


def row(seed=0, position=0, counts=None, seen=None, suppress=(), **params) -> SampleRow:
    return SampleRow(params=SamplingParams(**params), seed=seed, position=position,
                     output_counts=counts, seen_mask=seen, suppress=list(suppress))


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 1.0]])
    tokens, lps = sample(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert tokens == [1, 0] and lps is None


def test_logit_bias_of_minus_100_bans_a_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0]])
    tokens, _ = sample(logits, [row(temperature=0.0, logit_bias={1: -100.0})])
    assert tokens == [2]
    for seed in range(50):
        t, _ = sample(logits, [row(seed=seed, temperature=1.0, logit_bias={1: -100.0})])
        assert t != [1]


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, V)
    counts = torch.tensor([0, 1, 3, 0, 0, 0, 0, 0], dtype=torch.float)
    apply_penalties(logits, [row(counts=counts, presence_penalty=0.5, frequency_penalty=0.25)])
    # mu[j] - c[j] * frequency - (c[j] > 0) * presence
    assert torch.allclose(logits[0, :3], torch.tensor([0.0, -0.75, -1.25]))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0, 0, 0, 0]])
    seen = torch.tensor([True, True, False, False, False, False, False, False])
    apply_penalties(logits, [row(seen=seen, repetition_penalty=2.0)])
    assert logits[0, :4].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_batched_penalties_equal_each_rows_definition_in_a_mixed_batch():
    # rows with and without each penalty, side by side; each must get exactly its own
    torch.manual_seed(0)
    vocab, n = 64, 6
    logits = torch.randn(n, vocab) * 3
    counts = [torch.randint(0, 3, (vocab,)).float() * (torch.rand(vocab) < 0.2) for _ in range(n)]
    seen = [(c > 0) | (torch.rand(vocab) < 0.1) for c in counts]
    params = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.2),
              dict(), dict(repetition_penalty=0.8, frequency_penalty=-0.4),
              dict(presence_penalty=-1.0), dict(repetition_penalty=1.1, presence_penalty=0.3)]
    rows = [row(counts=c, seen=m, **p) for c, m, p in zip(counts, seen, params, strict=True)]
    want = logits.clone()
    for i, p in enumerate(params):
        r = p.get("repetition_penalty", 1.0)
        x = want[i]
        want[i] = torch.where(seen[i], torch.where(x > 0, x / r, x * r), x)
        want[i] -= p.get("frequency_penalty", 0.0) * counts[i]
        want[i] -= p.get("presence_penalty", 0.0) * (counts[i] > 0).float()
    apply_penalties(logits, rows)
    assert torch.allclose(logits, want)


def test_penalties_change_the_sampled_distribution():
    logits = torch.tensor([[2.0, 1.9, -5, -5, -5, -5, -5, -5]])
    counts = torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 0])
    plain = [sample(logits, [row(seed=s, temperature=1.0)])[0][0] for s in range(300)]
    pen = [sample(logits, [row(seed=s, temperature=1.0, counts=counts,
                               frequency_penalty=1.0)])[0][0] for s in range(300)]
    assert plain.count(0) > 120 and pen.count(0) < 30


def test_top_k_top_p_and_min_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]]))
    seen = {name: set() for name in ("k", "p", "minp")}
    for s in range(400):
        seen["k"].add(sample(logits, [row(seed=s, temperature=1.0, top_k=2)])[0][0])
        seen["p"].add(sample(logits, [row(seed=s, temperature=1.0, top_p=0.8)])[0][0])
        seen["minp"].add(sample(logits, [row(seed=s, temperature=1.0, min_p=0.25)])[0][0])
    assert seen["k"] == {0, 1}
    assert seen["p"] == {0, 1}  # 0.5 + 0.3 reaches 0.8
    assert seen["minp"] == {0, 1, 2}  # 0.15 >= 0.25 * 0.5


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-12, 1e-12, 1e-12, 1e-12, 1e-12]]))
    draws = [sample(logits, [row(seed=s, temperature=1.0)])[0][0] for s in range(3000)]
    for token, p in ((0, 0.6), (1, 0.3), (2, 0.1)):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws))


def test_seeded_draw_depends_only_on_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    rows = [row(seed=7, position=10, temperature=1.0), row(seed=1, position=3, temperature=0.7),
            row(temperature=0.0), row(seed=7, position=10, temperature=1.0)]
    tokens, _ = sample(logits.clone(), rows)
    alone, _ = sample(logits[:1].clone(), rows[:1])
    assert tokens[0] == alone[0]
    shuffled, _ = sample(logits[[3, 2, 1, 0]].clone(), [rows[3], rows[2], rows[1], rows[0]])
    assert shuffled[::-1] == tokens
    other_pos = [sample(logits[:1].clone(), [row(seed=7, position=p, temperature=1.0)])[0][0]
                 for p in range(20)]
    assert len(set(other_pos)) > 5


def test_logprobs_are_the_raw_log_softmax_with_top_k():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0, 0, 0, 0, 0]])
    tokens, lps = sample(logits, [row(temperature=0.0, logprobs=2, logit_bias={2: -100.0})])
    ref = torch.log_softmax(logits[0], -1)
    assert tokens == [1]
    assert abs(lps[0].logprob - ref[1].item()) < 1e-6
    assert [t for t, _ in lps[0].top] == [2, 1]


def test_suppressed_tokens_are_never_chosen():
    logits = torch.tensor([[9.0, 1.0, 0, 0, 0, 0, 0, 0]])
    assert sample(logits, [row(temperature=0.0, suppress=[0])])[0] == [1]


def _reference_nucleus(logits: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """The definitions, one row, by a full sort: min-p, then top-k, then the smallest set of
    best tokens holding a share p of what is left."""
    probs = logits.softmax(-1)
    probs = probs.masked_fill(probs < probs.max() * min_p, 0.0)
    vals, order = probs.sort(descending=True)
    if k:
        vals[k:] = 0.0
    cum = vals.cumsum(-1)
    vals = vals.masked_fill(cum - vals >= p * cum[-1], 0.0)
    return torch.zeros_like(probs).scatter_(0, order, vals)


def test_nucleus_over_a_large_vocabulary_matches_the_definition():
    # Peaked rows fit the first 1,024 candidates; flat ones need 8,192 or the whole row. Each
    # must keep exactly the reference's tokens with their probabilities, whatever the width.
    from services.scheduler.core.sampler import CANDIDATES, WIDER_CANDIDATES, nucleus

    torch.manual_seed(0)
    vocab = 12000
    cases = [(scale, k, p, m) for scale in (8.0, 3.0, 0.5, 0.05)
             for k, p, m in ((0, 0.95, 0.0), (0, 0.9, 0.02), (50, 0.8, 0.0), (3000, 0.99, 0.0),
                             (0, 0.999, 0.5))]
    widths_used = set()
    for scale, k, p, m in cases:
        logits = torch.randn(1, vocab) * scale
        ks = torch.tensor([k or vocab])
        for width in (min(CANDIDATES if not k else k, vocab), WIDER_CANDIDATES, vocab):
            ids, weights, short = nucleus(logits, width, ks, torch.tensor([p]),
                                          torch.tensor([m]))
            if not short[0]:
                break
        widths_used.add(width)
        got = torch.zeros(vocab).scatter_(0, ids[0], weights[0])
        want = _reference_nucleus(logits[0], k, p, m)
        assert torch.equal(got > 0, want > 0), (scale, k, p, m, width)
        assert torch.allclose(got, want, atol=1e-6)
    assert widths_used == {CANDIDATES, 50, 3000, WIDER_CANDIDATES, vocab}
