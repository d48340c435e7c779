"""LoRA adapters built and run by peft itself give the same logits through our runner, mixed
with other adapters and the base in one packed step; bad adapter directories fail naming the
problem."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.scheduler.executor.model_runner import ModelRunner
from services.scheduler.models.lora import load_adapter

# name -> LoraConfig arguments: ranks, targets (fused q/k/v and gate/up shards, o, down), rsLoRA
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"]),
    "mlp4rs": dict(r=4, lora_alpha=32, use_rslora=True, target_modules=["up_proj", "down_proj"]),
}


@dataclass
class Seq:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    lora_name: str | None = None


def peft_model(base: Path, config: dict, seed: int):
    """A peft LoRA model over `base` with non-zero B (peft starts B at zero: no change)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **config)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> (directory, peft's logits of PROMPTS[name])."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        model = peft_model(tiny_model_dir, config, seed)
        model.save_pretrained(str(root / name))
        with torch.no_grad():
            out[name] = (root / name, model(torch.tensor([PROMPTS[name]])).logits[0])
    return out


PROMPTS = {"qv8": list(range(1000, 1023)), "all16": list(range(2000, 2040)),
           "mlp4rs": list(range(3000, 3017)), None: list(range(4000, 4031))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_of_three_adapters_and_base_matches_peft(tiny_model_dir, adapters, dtype):
    """float32: within 1e-4 of peft's float32 logits (measured 4e-6). bfloat16 (whatever this
    CPU runs of it): off peft's float32 logits by under a fifth of what the adapter changes
    (measured 0.05-0.12 against 2.6-5.2)."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(tiny_model_dir, max_total_tokens=1024, device="cpu", dtype=dtype)
    runner.enable_lora({n: d for n, (d, _) in adapters.items()}, max_rank=16, max_per_batch=4)
    order = ["qv8", None, "all16", "mlp4rs"]
    reqs, next_block = [], 0
    for name in order:
        ids = PROMPTS[name]
        blocks = -(-len(ids) // runner.page_size)
        reqs.append(Seq(ids, block_table=list(range(next_block, next_block + blocks)),
                        lora_name=name))
        next_block += blocks
    lens = [len(r.prompt_ids) for r in reqs]
    logits = runner.forward(reqs, lens, lens).split(lens)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        refs = {None: base(torch.tensor([PROMPTS[None]])).logits[0]}
    refs.update({n: ref for n, (_, ref) in adapters.items()})
    for name, ours in zip(order, logits, strict=True):
        error = (ours.float() - refs[name]).abs().max().item()
        if name is None:
            assert error < (1e-4 if dtype == "float32" else 0.1), name
            continue
        effect = (refs[name] - base_logits(base, PROMPTS[name])).abs().max().item()
        assert effect > 1e-2, name  # the adapter really changes the output
        assert error < (1e-4 if dtype == "float32" else effect / 5), (name, error, effect)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_rows_through_the_kernel_match_peft(tiny_model_dir, adapters, dtype,
                                                   monkeypatch):
    """A decode-sized step (2 rows a request; one adapter's rows apart, an index group) goes
    through the C++ LoRA kernel and gives peft's logits within the prefill test's bounds."""
    from services.scheduler.models import lora

    calls = []
    kernel = lora.kernel_add
    monkeypatch.setattr(lora, "kernel_add", lambda *a: calls.append(a[-1]) or kernel(*a))
    runner = ModelRunner(tiny_model_dir, max_total_tokens=1024, device="cpu", dtype=dtype)
    runner.enable_lora({n: d for n, (d, _) in adapters.items()}, max_rank=16, max_per_batch=4)
    order = ["qv8", None, "all16", "qv8", "mlp4rs"]
    reqs, next_block = [], 0
    for name in order:
        blocks = -(-len(PROMPTS[name]) // runner.page_size)
        reqs.append(Seq(PROMPTS[name], block_table=list(range(next_block, next_block + blocks)),
                        lora_name=name))
        next_block += blocks
    heads = [len(r.prompt_ids) - 2 for r in reqs]
    runner.forward(reqs, heads, heads)
    for r, n in zip(reqs, heads, strict=True):
        r.num_computed = n
    logits = runner.forward(reqs, [2] * len(reqs), [2] * len(reqs)).split(2)
    assert calls and all(g.count <= lora.KERNEL_ROWS for g in calls)
    assert any(g.index.numel() == 4 for g in calls)  # qv8's rows 0-1 and 6-7
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for name, ours in zip(order, logits, strict=True):
        plain = base_logits(base, PROMPTS[name])[-2:]
        ref = plain if name is None else adapters[name][1][-2:]
        error = (ours.float() - ref).abs().max().item()
        # bfloat16: as the prefill's test, under a fifth of what the adapter changes
        bound = 0.1 if name is None else (ref - plain).abs().max().item() / 5
        assert error < (1e-4 if dtype == "float32" else bound), (name, error)


def base_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _runner_model(tiny_model_dir):
    return ModelRunner(tiny_model_dir, max_total_tokens=256, device="cpu",
                       dtype="float32").model


def test_bad_adapter_dirs_name_the_problem(tiny_model_dir, adapters, tmp_path):
    import shutil

    model = _runner_model(tiny_model_dir)
    src = adapters["all16"][0]
    with pytest.raises(ValueError, match="rank 16 exceeds --max-lora-rank 8"):
        load_adapter("x", src, model, max_rank=8)
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors missing"):
        load_adapter("x", missing, model, max_rank=16)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="adapter_model.safetensors corrupt"):
        load_adapter("x", corrupt, model, max_rank=16)
    unknown = tmp_path / "unknown"
    shutil.copytree(src, unknown)
    config = json.loads((unknown / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "fc_in"]
    (unknown / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fc_in"):
        load_adapter("x", unknown, model, max_rank=16)
    with pytest.raises(ValueError, match="adapter_config.json missing"):
        load_adapter("x", tmp_path, model, max_rank=16)


def test_engine_mixed_adapters_generate_as_each_alone(tiny_model_dir, adapters):
    """Greedy tokens per request in one engine mixing 3 adapters and the base (two adapters a
    step at most, so some wait) equal each request served alone; the same prompt under each
    adapter shares no cached block."""
    from common.block_hash import prefix_block_hashes
    from common.messages import SamplingParams, TokenizedReq
    from services.scheduler.core.engine import EngineCore
    from tests.helpers import engine_args, run_engine

    paths = [f"{n}={d}" for n, (d, _) in adapters.items()]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(500, 540))
    names = [None, *ADAPTERS] * 2

    def reqs(which):
        return [TokenizedReq(rid=str(i), gateway_id="g", input_ids=prompt, params=params,
                             lora_name=names[i]) for i in which]

    def engine():
        return EngineCore(engine_args(tiny_model_dir, lora_paths=paths, max_loras_per_batch=2,
                                      debug_check_integrity=True))

    mixed, _, _ = run_engine(engine(), reqs(range(len(names))))
    alone = engine()
    for i in range(len(ADAPTERS) + 1):
        tokens, _, _ = run_engine(alone, reqs([i]))
        assert mixed[str(i)] == tokens[str(i)] == mixed[str(i + len(ADAPTERS) + 1)], names[i]
    assert len({tuple(mixed[str(i)]) for i in range(len(ADAPTERS) + 1)}) == len(ADAPTERS) + 1
    firsts = {prefix_block_hashes(prompt, 16, None, n)[0] for n in [None, *ADAPTERS]}
    assert len(firsts) == len(ADAPTERS) + 1
    alone.check_integrity()


def test_adapters_past_the_bound_are_evicted_and_read_back(tiny_model_dir, adapters):
    from services.scheduler.models.lora import LoraSet

    lora = LoraSet(_runner_model(tiny_model_dir), {n: d for n, (d, _) in adapters.items()},
                   max_rank=16, max_per_batch=1, max_loaded=1)
    first = lora.get("qv8")
    assert lora.get("qv8") is first  # kept while it is the most recent
    lora.get("all16")
    assert list(lora.loaded) == ["all16"]
    again = lora.get("qv8")
    assert again is not first and torch.equal(again.weights["layers.0.self_attn.qkv_proj"][0],
                                              first.weights["layers.0.self_attn.qkv_proj"][0])
    with pytest.raises(ValueError, match="--max-loras-per-batch 1"):
        lora.activate(["qv8", "all16"], [1, 1])


def test_smollm2_adapter_matches_peft(smol_path, tmp_path):
    """The real model: an adapter on every projection, our float32 logits within 1e-3 of peft's
    run in float64, and at most twice as far from it as peft's own float32 run (float32 sums in
    another order: against peft's float32 itself the gap was 1.2e-3 to 2.9e-3 depending on the
    CPU's kernels, AVX2 EPYC and AMX Xeon)."""
    config = dict(r=16, lora_alpha=32, target_modules=list(TARGETS_ALL))
    model = peft_model(smol_path, config, seed=7)
    model.save_pretrained(str(tmp_path / "smol"))
    ids = list(range(1000, 1040))
    with torch.no_grad():
        ref32 = model(torch.tensor([ids])).logits[0]
        ref64 = model.double()(torch.tensor([ids])).logits[0]
    runner = ModelRunner(smol_path, max_total_tokens=512, device="cpu", dtype="float32")
    runner.enable_lora({"smol": tmp_path / "smol"}, max_rank=16, max_per_batch=1)
    ours = runner.forward([Seq(ids, block_table=[0, 1, 2], lora_name="smol")], [40], [40])
    ours_err = (ours.double() - ref64).abs().max().item()
    peft_err = (ref32.double() - ref64).abs().max().item()
    print(f"max |logit - float64|: ours {ours_err:.3g}, peft float32 {peft_err:.3g}")
    assert ours_err < 1e-3 and ours_err <= 2 * peft_err


TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("mode", ["int8"])
def test_adapter_on_a_quantized_base_stays_float(tiny_model_dir, adapters, mode):
    """--quantization: the adapter's factors stay float32 beside the quantized base, and its
    logits follow peft's float32 ones within a fifth of what the adapter changes. Not int4:
    on this tiny random model int4's own error (1.1 in the logits) is of the adapter's size,
    so peft's float32 logits are no reference for it."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu", dtype="float32",
                         quantization=mode)
    runner.enable_lora({"all16": adapters["all16"][0]}, max_rank=16, max_per_batch=1)
    assert all(a.dtype == torch.float32 for ab in runner.lora.get("all16").weights.values()
               for a in ab)
    ids = PROMPTS["all16"]
    ours = runner.forward([Seq(ids, block_table=[0, 1, 2], lora_name="all16")], [len(ids)],
                          [len(ids)])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ref = adapters["all16"][1]
    effect = (ref - base_logits(base, ids)).abs().max().item()
    assert (ours - ref).abs().max().item() < effect / 5


def peft_delta_slots(model_dir: Path, adapter_dir: Path) -> dict[str, object]:
    """Our Linear's name -> an adapter slot that adds PEFT's x @ A.T @ B.T * alpha / r to each
    targeted module's columns, computed in float64 from the files themselves (the layout
    written out here from the model's config, apart from models/lora.py's)."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    inter = cfg["intermediate_size"]
    where = {"q_proj": ("self_attn.qkv_proj", 0, q), "k_proj": ("self_attn.qkv_proj", q, q + kv),
             "v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
             "o_proj": ("self_attn.o_proj", 0, None), "gate_proj": ("mlp.gate_up_proj", 0, inter),
             "up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
             "down_proj": ("mlp.down_proj", 0, None)}
    parts: dict[str, list] = {}
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        layer = int(key.split(".layers.")[1].split(".")[0])
        module = key.split(".lora_A.")[0].rsplit(".", 1)[1]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        linear, lo, hi = where[module]
        parts.setdefault(f"layers.{layer}.{linear}", []).append((lo, hi, a.double(), b.double()))

    def slot(pieces):
        def add(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            for lo, hi, a, b in pieces:
                out[:, lo:hi] += ((x.double() @ a.T @ b.T) * scale).to(out.dtype)
            return out
        return add

    return {name: slot(pieces) for name, pieces in parts.items()}


def test_adapter_on_an_int4_base_adds_exactly_peft_s_part(tiny_model_dir, adapters):
    """--quantization int4: the adapter beside the int4 base (prefill rows, then a decode
    step's through the kernel) gives the logits of the same int4 base with PEFT's own formula
    added in float64 at every targeted module: the int4 base computes the same either way, so
    they agree to float32's rounding, and both differ from the int4 base alone."""
    from services.scheduler.models.linear import Linear

    name, ids = "all16", PROMPTS["all16"]

    def run(runner):
        seq = Seq(ids, block_table=[0, 1, 2], lora_name=name if runner.lora else None)
        first = runner.forward([seq], [len(ids) - 2], [len(ids) - 2])
        seq.num_computed = len(ids) - 2
        return torch.cat([first, runner.forward([seq], [2], [2])])

    ours = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu", dtype="float32",
                       quantization="int4")
    ours.enable_lora({name: adapters[name][0]}, max_rank=16, max_per_batch=1)
    ref = ModelRunner(tiny_model_dir, max_total_tokens=512, device="cpu", dtype="float32",
                      quantization="int4")
    plain = run(ref)
    slots = peft_delta_slots(tiny_model_dir, adapters[name][0])
    linears = {n: m for n, m in ref.model.named_modules() if isinstance(m, Linear)}
    assert linears[next(iter(slots))].quantized is not None  # the int4 base, not a float one
    for target, add in slots.items():
        linears[target].set_adapter(add)
    want, got = run(ref), run(ours)
    assert (want - plain).abs().max().item() > 1e-2  # the adapter really changes the output
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()


def _other_base(src: Path, dst: Path) -> Path:
    """`src` with every lora_A one input column wider: an adapter made for another model."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    wider = {k: torch.cat([t, t[:, :1]], dim=1) if "lora_A" in k else t
             for k, t in tensors.items()}
    save_file(wider, str(dst / "adapter_model.safetensors"))
    return dst


def _lora_engine(tiny_model_dir, **kw):
    from services.scheduler.core.engine import EngineCore
    from tests.helpers import engine_args

    return EngineCore(engine_args(tiny_model_dir, debug_check_integrity=True, **kw))


def _gen(engine, name: str | None, rid: str = "r", n: int = 8) -> list[int]:
    from common.messages import SamplingParams, TokenizedReq
    from tests.helpers import run_engine

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    tokens, finish, _ = run_engine(engine, [TokenizedReq(
        rid=rid, gateway_id="g", input_ids=list(range(500, 530)), params=params,
        lora_name=name)])
    assert finish[rid].kind == "length", finish[rid]
    return tokens[rid]


def test_runtime_load_refuses_bad_adapters_naming_them_and_serves_a_good_one(
        tiny_model_dir, adapters, tmp_path):
    """Each refusal is a 400 naming the problem and changes nothing; the adapter loaded at
    runtime generates what the same adapter given at start-up does."""
    engine = _lora_engine(tiny_model_dir, enable_lora=True, max_lora_rank=8)
    bad_target = tmp_path / "fc"
    import shutil

    shutil.copytree(adapters["qv8"][0], bad_target)
    config = json.loads((bad_target / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "fc_in"]
    (bad_target / "adapter_config.json").write_text(json.dumps(config))
    refusals = {
        "rank 16 exceeds --max-lora-rank 8": adapters["all16"][0],
        "nowhere: no such directory": tmp_path / "nowhere",
        "adapter_config.json missing": tmp_path,
        "'fc_in'": bad_target,
        "another base model": _other_base(adapters["qv8"][0], tmp_path / "other"),
    }
    for why, path in refusals.items():
        reply = engine.load_lora("x", str(path))
        assert (reply.status, reply.param) == (400, "lora_path") and why in reply.message, reply
        assert engine.loras.adapters == {} and engine.loras.refusal("x") is not None
    assert engine.load_lora("qv8", str(adapters["qv8"][0])).status == 200
    again = engine.load_lora("qv8", str(adapters["mlp4rs"][0]))
    assert again.status == 400 and "already loaded" in again.message
    tiny = engine.info.name
    assert "base model" in engine.load_lora(tiny, str(adapters["qv8"][0])).message
    at_start = _lora_engine(tiny_model_dir, lora_paths=[f"qv8={adapters['qv8'][0]}"])
    assert _gen(engine, "qv8") == _gen(at_start, "qv8") != _gen(engine, None)
    assert engine.unload_lora("qv8").status == 200 and engine.loras.adapters == {}
    assert "not served" in engine.loras.refusal("qv8")
    gone = engine.unload_lora("qv8")
    assert gone.status == 404 and "qv8" in gone.message
    engine.check_integrity()


def test_unloading_an_adapter_in_use_drains_it(tiny_model_dir, adapters):
    """Unload while a request runs under it: that request keeps every token, a new one is
    refused naming the adapter, a reload waits for the drain; then it is gone."""
    from common.messages import SamplingParams, TokenizedReq

    engine = _lora_engine(tiny_model_dir, lora_paths=[f"qv8={adapters['qv8'][0]}"])
    alone = _gen(engine, "qv8", "alone", n=12)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    engine.submit(TokenizedReq(rid="run", gateway_id="g", input_ids=list(range(500, 530)),
                               params=params, lora_name="qv8"))
    tokens = [t for out in engine.step() for t in out.token_ids]
    reply = engine.unload_lora("qv8")
    assert reply.status == 200 and reply.running == 1 and "unloading" in reply.message
    assert engine.loras.adapters == {}  # no new request
    assert "being unloaded" in engine.load_lora("qv8", str(adapters["qv8"][0])).message
    engine.submit(TokenizedReq(rid="late", gateway_id="g", input_ids=[1, 2, 3], params=params,
                               lora_name="qv8"))
    finish = {}
    while engine.has_work():
        for out in engine.step():
            if out.rid == "run":
                tokens += out.token_ids
            if out.finish is not None:
                finish[out.rid] = out.finish
    assert finish["run"].kind == "length" and tokens == alone
    assert finish["late"].kind == "error" and "being unloaded" in finish["late"].message
    assert "qv8" not in engine.runner.lora.paths and not engine.loras.draining
    # the name back with other weights: the steps use them, not the slots the old ones filled
    assert engine.load_lora("qv8", str(adapters["mlp4rs"][0])).status == 200
    mlp = _lora_engine(tiny_model_dir, lora_paths=[f"qv8={adapters['mlp4rs'][0]}"])
    assert _gen(engine, "qv8", "again", n=12) == _gen(mlp, "qv8", "mlp", n=12) != alone
    engine.check_integrity()


def test_runtime_load_without_lora_enabled_names_the_flag(tiny_model_dir, adapters):
    engine = _lora_engine(tiny_model_dir)
    reply = engine.load_lora("qv8", str(adapters["qv8"][0]))
    assert reply.status == 400 and "--enable-lora" in reply.message
    assert engine.unload_lora("qv8").status == 400


def test_offline_engine_takes_an_adapter_per_prompt(tiny_model_dir, adapters):
    """`Engine(lora_paths=...)`'s generate with lora_name per prompt gives each prompt what
    the engine core gives it under that adapter; an adapter loaded later works the same."""
    from tokenline import Engine

    dirs = {n: str(d) for n, (d, _) in adapters.items()}
    engine = Engine(str(tiny_model_dir), lora_paths={"qv8": dirs["qv8"]},
                    max_total_tokens=4096)
    prompt = list(range(500, 530))
    params = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate([prompt, prompt], params, use_tqdm=False, lora_name=["qv8", None])
    core = _lora_engine(tiny_model_dir, lora_paths=[f"qv8={dirs['qv8']}"])
    assert outs[0].token_ids == _gen(core, "qv8") != outs[1].token_ids == _gen(core, None)
    with pytest.raises(ValueError, match="'all16' is not served"):
        engine.generate(prompt, params, use_tqdm=False, lora_name="all16")
    engine.load_lora_adapter("all16", dirs["all16"])
    (out,) = engine.generate(prompt, params, use_tqdm=False, lora_name="all16")
    assert out.token_ids == _gen(_lora_engine(tiny_model_dir, lora_paths=[
        f"all16={dirs['all16']}"]), "all16")
    engine.unload_lora_adapter("all16")
    with pytest.raises(ValueError, match="does not exist"):
        engine.unload_lora_adapter("all16")


_PLAIN_UNDER_ADAPTERS: dict[str, dict] = {}


@pytest.mark.parametrize("spec", [
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "SELF", "speculative_draft_layers": 1},
    {"speculative_algorithm": "SELF", "speculative_draft_model_quantization": "int8"},
    {"speculative_algorithm": "STANDALONE"},
], ids=["NGRAM", "SELF-1-layer", "SELF-int8", "STANDALONE"])
def test_adapters_keep_their_output_under_speculation(tiny_model_dir, adapters, spec):
    """Greedy requests under three adapters and the base, in one batch, give the same tokens
    with drafts as without: the target verifies under each request's adapter whatever drafted
    (SELF's first layers under the same adapter, a quantized copy and a draft model without)."""
    from common.messages import SamplingParams, TokenizedReq
    from services.scheduler.core.engine import EngineCore
    from tests.helpers import engine_args, run_engine

    paths = [f"{n}={d}" for n, (d, _) in adapters.items()]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    names = [None, *ADAPTERS]
    # a repeated phrase, so that n-gram lookup finds something to draft
    prompts = [[700 + 3 * i + j % 7 for j in range(35)] for i in range(len(names))]
    reqs = [TokenizedReq(rid=str(i), gateway_id="g", input_ids=prompts[i], params=params,
                         lora_name=names[i]) for i in range(len(names))]
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": str(tiny_model_dir)}

    def run(**flags):
        engine = EngineCore(engine_args(tiny_model_dir, lora_paths=paths, max_loras_per_batch=4,
                                        debug_check_integrity=True, **flags))
        tokens, _, _ = run_engine(engine, reqs)
        engine.check_integrity()
        return engine, tokens

    if "plain" not in _PLAIN_UNDER_ADAPTERS:  # the run without drafts, once per module
        _PLAIN_UNDER_ADAPTERS["plain"] = run()[1]
    plain = _PLAIN_UNDER_ADAPTERS["plain"]
    engine, drafted = run(speculative_num_draft_tokens=3, speculative_disable_by_batch_size=4,
                          **spec)  # all four requests draft
    assert drafted == plain
    assert len({tuple(t) for t in plain.values()}) == len(names)  # the adapters do differ
    assert engine.spec.stats.num_drafts > 0 and engine.spec.stats.num_accepted_tokens > 0
