"""`python -m bench.prefill_chunks` on the tiny model: every configuration runs the same long
prompt, in as many prefill steps as its chunk size makes."""

from __future__ import annotations

import json
import math

import pytest

from bench import prefill_chunks
from bench.long_workloads import long_2k


def test_each_configuration_prefills_in_chunks_of_its_size(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "chunks.json"
    assert prefill_chunks.main(["--model", str(tiny_model_dir), "--workload", "long-2k",
                                "--num-prompts", "1", "--output-tokens", "3", "--rounds", "2",
                                "--configs", "256/1024,1024/1024", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    prompt_len = len(long_2k(0)[0].prompt)
    # the second round runs the configurations in reverse
    assert [(r["round"], r["chunk"]) for r in rows] == [(0, 256), (0, 1024), (1, 1024), (1, 256)]
    for r in rows:
        # the prompt in ceil(len / chunk) steps (its last one samples the first token), then
        # a decode step for each further token
        assert r["steps"] == math.ceil(prompt_len / r["chunk"]) + 3 - 1
        assert r["wall_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_max_s"] <= r["wall_s"]
    assert "medians of the rounds" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["512", "512/", "0/2048", "a/b", "512/2048,"])
def test_a_malformed_configuration_is_refused(text, capsys):
    with pytest.raises(SystemExit) as e:
        prefill_chunks.main(["--configs", text])
    assert e.value.code == 2
    assert "--configs" in capsys.readouterr().err
