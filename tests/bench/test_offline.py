"""`tokenline bench offline --quick` runs every system on the tiny model and reports them."""

from __future__ import annotations

import json

from bench.offline import QUICK_OUTPUT, QUICK_REQUESTS, Result, format_report
from tokenline.cli import main as cli_main


def test_quick_run_reports_every_system_with_ratios_and_the_roofline(tiny_model_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "offline.json"
    rc = cli_main(["bench", "offline", "--quick", "--model", str(tiny_model_dir),
                   "--hf-batch-sizes", "1,4", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["results"]]
    assert systems == [
        "tokenline continuous", "tokenline static", "tokenline dynamic",
        "transformers generate, batch 1", "transformers generate, batch 4",
        "transformers continuous",
    ]
    assert report["num_requests"] == QUICK_REQUESTS
    for r in report["results"]:
        assert r["output_tokens"] == report["output_tokens"] <= QUICK_REQUESTS * QUICK_OUTPUT
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0
    # the same greedy tokens as transformers, request by request
    assert report["greedy_agreement"] == {"requests": QUICK_REQUESTS, "identical": QUICK_REQUESTS}
    roof = report["roofline"]
    assert roof["batch"] == QUICK_REQUESTS and roof["steps"] >= 1
    assert roof["bound_ms"] > 0 and 0 < roof["fraction_of_bound"]
    if report["machine"]["onednn_flops_per_s"]:  # the stricter bound, at oneDNN's peak
        assert 0 < roof["strict_bound_ms"] <= roof["bound_ms"]
    printed = capsys.readouterr().out
    assert "vs best baseline" in printed and "of the roofline" in printed


def test_ratios_are_to_the_fastest_transformers_baseline():
    results = [
        Result("tokenline continuous", 10.0, 1000, 10),
        Result("transformers generate, batch 1", 100.0, 1000, 10),
        Result("transformers generate, batch 8", 40.0, 1000, 10),
    ]
    text = format_report(results, None, "header")
    line = next(x for x in text.splitlines() if x.startswith("tokenline continuous"))
    assert line.endswith("4.00x")  # 100 tok/s against batch 8's 25 tok/s
    assert "best baseline: transformers generate, batch 8 (25.0 tok/s)" in text
