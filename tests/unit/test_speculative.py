"""Speculative decoding's pieces: which drafts a request gets, how many verification keeps, and
the flags' start-up errors."""

from __future__ import annotations

import json

import pytest

from common.config import ServerArgs, parse_server_args
from common.messages import SamplingParams
from services.scheduler.core.request import Request, Status
from services.scheduler.core.speculative import (
    SpecConfig,
    Speculator,
    accepted_prefix,
    grammar_prefix,
    spec_config,
)


class Repeat:
    """Proposes k copies of one token."""

    def new_state(self):
        return None

    def propose(self, tokens, k, state=None):
        return [7] * k


def _decoding(max_new: int | None = 100, prompt: int = 10, out: int = 3, **kw) -> Request:
    req = Request(rid="r", prompt_ids=list(range(prompt)),
                  params=SamplingParams(max_new_tokens=max_new, **kw),
                  output_ids=[5] * out)
    req.status = Status.RUNNING
    req.num_computed = req.num_tokens - 1
    return req


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix([], [4]) == 0
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 9]) == 3
    assert accepted_prefix([1, 2, 3], [1, 5, 3, 9]) == 1
    assert accepted_prefix([1, 2, 3], [0, 2, 3, 9]) == 0


def test_drafts_go_to_decoding_requests_within_their_budget():
    spec = Speculator(SpecConfig(num_draft_tokens=4, disable_by_batch_size=3), 64, Repeat())
    decoding, near_limit, prefilling = _decoding(), _decoding(max_new=5), _decoding()
    prefilling.num_computed = 4
    penalised = _decoding(presence_penalty=0.5)
    near_context = _decoding(max_new=None, prompt=58)  # 61 tokens of a 64-token context
    spec.propose([decoding, near_limit, prefilling])
    assert decoding.draft_ids == [7, 7, 7, 7]
    assert near_limit.draft_ids == [7]  # 3 out, 5 at most: the draft and the token after it
    assert prefilling.draft_ids == []
    spec.propose([penalised, near_context])
    assert penalised.draft_ids == []  # penalties count the output: no per-row replay
    assert near_context.draft_ids == [7, 7]


def test_no_drafts_above_the_batch_size_threshold():
    spec = Speculator(SpecConfig(disable_by_batch_size=2), 64, Repeat())
    reqs = [_decoding() for _ in range(3)]
    reqs[0].draft_ids = [1]  # from an earlier step
    spec.propose(reqs)
    assert all(r.draft_ids == [] for r in reqs)


def test_the_grammar_cuts_drafts_it_forbids_and_its_end(smol_path):
    from services.scheduler.core.grammar import XGrammarBackend

    backend = XGrammarBackend(smol_path / "tokenizer.json", 49152, [2])
    compiled = backend.compile("json", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}))
    req = _decoding()
    req.matcher = backend.matcher(compiled)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol_path / "tokenizer.json"))
    good = tok.encode('{"a": 12}').ids
    assert grammar_prefix(req, good + [2, 5]) == good  # the end (EOS) is the row's to sample
    assert grammar_prefix(req, good[:2] + tok.encode("x").ids + good[2:]) == good[:2]
    for t in good:  # the matcher was rolled back each time: it takes the real tokens
        assert req.matcher.accept(t)
    assert req.matcher.accept(2) and req.matcher.is_terminated()


@pytest.mark.parametrize("argv, message", [
    (["--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens must be in"),
    (["--speculative-ngram-min-match-window-size", "9"],
     "--speculative-ngram-min-match-window-size must be >= 1 and <= "
     "--speculative-ngram-max-match-window-size, not 9 and 8"),
    (["--speculative-disable-by-batch-size", "0"], "--speculative-disable-by-batch-size must"),
    (["--speculative-algorithm", "EAGLE"], "argument --speculative-algorithm: invalid choice"),
    (["--speculative-algorithm", "STANDALONE"],
     "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"),
    (["--speculative-draft-model-path", "/m"],
     "--speculative-draft-model-path is for --speculative-algorithm STANDALONE, not NGRAM"),
    (["--speculative-algorithm", "SELF"],
     "--speculative-algorithm SELF needs --speculative-draft-layers (or a quantized draft"),
    (["--speculative-draft-model-quantization", "int4"],
     "--speculative-draft-model-quantization is for --speculative-algorithm STANDALONE or "
     "SELF, not NGRAM"),
    (["--speculative-algorithm", "SELF", "--quantization", "int8",
      "--speculative-draft-model-quantization", "int8"],
     "--speculative-draft-model-quantization int8 is the target's own --quantization: SELF's "
     "draft would be the target's own weights, leave it unset"),
    (["--speculative-algorithm", "SELF", "--speculative-draft-model-quantization", "int2"],
     "argument --speculative-draft-model-quantization: invalid choice: 'int2'"),
    (["--speculative-draft-layers", "20"],
     "--speculative-draft-layers is for --speculative-algorithm SELF, not NGRAM"),
    (["--speculative-algorithm", "SELF", "--speculative-draft-layers", "0"],
     "--speculative-draft-layers must be >= 1, not 0"),
])
def test_bad_speculative_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--speculative-algorithm", "NGRAM", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_offline_engine_gets_the_same_errors():
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be in"):
        spec_config(ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=-1))
    assert spec_config(ServerArgs()) is None
    ngram = spec_config(ServerArgs(speculative_algorithm="NGRAM"))
    assert (ngram.num_draft_tokens, ngram.ngram_min, ngram.ngram_max) == (8, 1, 8)
    assert ngram.disable_by_batch_size == 8
    standalone = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="/m")
    assert (spec_config(standalone).num_draft_tokens,
            spec_config(standalone).disable_by_batch_size) == (4, 3)
    self_draft = spec_config(ServerArgs(speculative_algorithm="SELF", speculative_draft_layers=20))
    assert (self_draft.num_draft_tokens, self_draft.draft_layers) == (4, 20)
    assert self_draft.disable_by_batch_size == 3  # a draft model's forwards grow with the batch
    assert spec_config(ServerArgs(speculative_algorithm="SELF", speculative_draft_layers=20,
                                  speculative_disable_by_batch_size=6)).disable_by_batch_size == 6
    with pytest.raises(ValueError, match="--speculative-algorithm SELF needs "
                       "--speculative-draft-layers"):
        spec_config(ServerArgs(speculative_algorithm="SELF"))
    quantized = spec_config(ServerArgs(speculative_algorithm="SELF",
                                       speculative_draft_model_quantization="int4"))
    assert (quantized.draft_layers, quantized.draft_quantization) == (None, "int4")
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization is for "
                       "--speculative-algorithm STANDALONE or SELF, not no speculation"):
        spec_config(ServerArgs(speculative_draft_model_quantization="int4"))
    with pytest.raises(ValueError, match="--speculative-draft-layers is for "
                       "--speculative-algorithm SELF, not no speculation"):
        spec_config(ServerArgs(speculative_draft_layers=3))
    assert spec_config(ServerArgs(speculative_algorithm="NGRAM",
                                  speculative_num_draft_tokens=3)).num_draft_tokens == 3
