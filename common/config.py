"""Server flags, shared by every service and the launcher.

Each flag `--some-flag` also reads the environment variable `TOKENLINE_SOME_FLAG`; the command
line wins. Every service parses the same flags, so the launcher hands its argv to each child.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from typing import Any


def _flag(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    # where
    host: str = _flag("127.0.0.1", "HTTP listen address of the gateway")
    port: int = _flag(8000, "HTTP port of the gateway")
    model: str | None = _flag(None, "local transformers directory or GGUF file (default SmolLM2)")
    served_model_name: str | None = _flag(None, "model name in the API (default: from --model)")
    nats_url: str | None = _flag(None, "NATS server URL, comma-separated for several seeds of a "
                                 "cluster (serve: embedded server if unset)")
    nats_cluster: int = _flag(1, "serve: how many local nats-server nodes to start, routed into "
                              "one cluster and each supervised; every service gets all their "
                              "URLs and fails over between them (1: one embedded server; not "
                              "with --nats-url)")
    nats_user: str | None = _flag(None, "NATS user")
    nats_password: str | None = _flag(None, "NATS password")
    nats_token: str | None = _flag(None, "NATS token")
    subject_prefix: str = _flag("tl", "prefix of every NATS subject")
    instance_id: str | None = _flag(None, "this service instance's id (default: random)")
    cache_dir: str | None = _flag(None, "where converted models are cached")
    chat_template: str | None = _flag(None, "Jinja chat template file for /v1/chat/completions "
                                      "(default: the model's own; a model without one answers "
                                      "chat requests with a 400)")
    # engine
    device: str = _flag("auto", "cpu, cuda, cuda:N or auto", type="device")
    dtype: str = _flag("auto", "float32, bfloat16, float16 or auto (float32 on CPU, bf16 on "
                       "CUDA); bfloat16 on CPU is bfloat16 end to end with AVX512-BF16, in the "
                       "projections only with AVX512 but no BF16, and everywhere but the "
                       "projections on AVX2 (they run float32 from the bfloat16 weights: "
                       "oneDNN has no bfloat16 there); the start-up log says which",
                       choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str = _flag(
        "none", "weight-only quantization of every projection, in groups of 32: int8 (a "
        "GGUF's Q8_0 blocks as they are) or int4 (its Q4_0, Q4_1 and Q4_K blocks); the lm_head "
        "and embedding are int8 in both; CPU kernels, dequantized on load on CUDA",
        choices=["none", "int8", "int4"])
    lora_paths: list[str] | None = _flag(
        None, "LoRA adapters (PEFT directories) served beside the base: name=path ...; a "
        "request picks one by `model` (or `lora_path`) = its name", nargs="+",
        aliases=("--lora-modules",))
    enable_lora: bool = _flag(False, "serve LoRA adapters: loaded at runtime by "
                              "/load_lora_adapter (on whenever --lora-paths is given)")
    max_loras_per_batch: int = _flag(4, "most distinct LoRA adapters in one step (requests "
                                     "for others wait in the queue)")
    max_lora_rank: int = _flag(16, "largest LoRA rank an adapter may have (a larger one is "
                               "refused, at start-up or by /load_lora_adapter)")
    attention_backend: str = _flag("auto", "auto, torch or triton",
                                   choices=["auto", "torch", "triton"])
    num_threads: int | None = _flag(None, "torch CPU threads of the model worker")
    omp_threads_bind: str = _flag(
        "none", "pin the scheduler's OpenMP threads one per core: a core list such as 0-1 or "
        "0,2,4-5, auto (every core this process may use) or none (the OS places them); sets "
        "OMP_PLACES, OMP_PROC_BIND and the process's CPU affinity (tokenline serve; a scheduler "
        "started alone must be started so, or it refuses the flag)",
        type="cpu_list")
    malloc: str = _flag("auto", "the scheduler process's malloc, preloaded by tokenline serve: "
                        "tcmalloc, jemalloc, system (glibc's), or auto (tcmalloc, else jemalloc, "
                        "else system; a scheduler started alone: whatever its LD_PRELOAD gives, "
                        "and a named one it does not run is refused)",
                        choices=["auto", "tcmalloc", "jemalloc", "system"])
    page_size: int = _flag(16, "tokens per KV block")
    max_total_tokens: int | None = _flag(None, "KV pool size in tokens (overrides the fraction)")
    mem_fraction_static: float = _flag(0.9, "fraction of memory for weights and KV pool")
    cpu_memory_gib: float = _flag(4.0, "memory budget on CPU that --mem-fraction-static applies to")
    max_model_len: int | None = _flag(None, "context length (default: the model's)")
    max_running_requests: int = _flag(128, "most requests in the running batch")
    max_queued_requests: int = _flag(1024, "most requests waiting; beyond it new ones get 503")
    chunked_prefill_size: int = _flag(2048, "most prompt tokens of one request in one step")
    max_prefill_tokens: int = _flag(2048, "most prompt tokens in one step, all requests")
    schedule_policy: str = _flag(
        "sjf", "waiting-queue order: sjf (shortest prompt first, up to --sjf-max-wait), fcfs, "
        "lpm (longest cached prefix first) or priority", choices=["sjf", "fcfs", "lpm", "priority"])
    sjf_max_wait: float = _flag(5.0, "sjf: seconds a request may wait before shorter prompts no "
                                "longer go ahead of it (0: arrival order)")
    retraction_policy: str = _flag("length", "who is retracted first when KV runs out",
                                   choices=["length", "priority"])
    schedule_conservativeness: float = _flag(
        1.0, "how much of running requests' remaining output admission reserves (0: none)")
    batching: str = _flag("continuous", "batching policy",
                          choices=["continuous", "static", "dynamic"])
    batch_wait_ms: float = _flag(20.0, "dynamic batching: longest wait to fill a batch")
    disable_prefix_cache: bool = _flag(False, "turn the prefix cache off")
    debug_check_integrity: bool = _flag(False, "check the KV pool's books whenever idle")
    # speculative decoding (SGLang's names)
    speculative_algorithm: str | None = _flag(
        None, "speculative decoding: NGRAM (prompt lookup: drafts copied from the request's own "
        "prompt and output, no extra model), STANDALONE (a smaller draft model with the "
        "same vocabulary, --speculative-draft-model-path) or SELF (ours, not SGLang's: the "
        "target's own first --speculative-draft-layers layers and its head, no extra "
        "weights, or a quantized copy of them: --speculative-draft-model-quantization); "
        "unset: off",
        choices=["NGRAM", "STANDALONE", "SELF"])
    speculative_draft_model_path: str | None = _flag(
        None, "STANDALONE: the draft model, a transformers directory or GGUF file")
    speculative_draft_layers: int | None = _flag(
        None, "SELF: how many of the target's first layers draft (>= 1, fewer than the "
        "model has; all of them with --speculative-draft-model-quantization); required for "
        "SELF unless its draft is quantized")
    speculative_draft_model_quantization: str | None = _flag(
        None, "the draft's weights quantized (SGLang's name): STANDALONE loads its draft model "
        "so; SELF runs an int8 or int4 copy of the target's own weights (read again from its "
        "files, --speculative-draft-layers of its layers, unset: all) as the draft, so a "
        "float target's exact output comes at nearer the quantized model's speed; unset or "
        "none: the draft runs as loaded", choices=["none", "int8", "int4"])
    speculative_num_draft_tokens: int | None = _flag(
        None, "draft tokens proposed per request per step, verified in one forward; unset: 8 "
        "for NGRAM (which drafts at most n + 1 after a suffix of n tokens matched), 4 for "
        "STANDALONE and SELF")
    speculative_ngram_min_match_window_size: int = _flag(
        1, "NGRAM: shortest suffix of the tokens so far that is looked up earlier in them")
    speculative_ngram_max_match_window_size: int = _flag(
        8, "NGRAM: longest such suffix (the longest that matches wins)")
    speculative_disable_by_batch_size: int | None = _flag(
        None, "no drafts while more requests than this run (a large batch is compute-bound, "
        "and a draft model's forwards grow with it); unset: 8 for NGRAM, 3 for STANDALONE and "
        "SELF")
    # routing (the tokenizer picks the scheduler; names as SGLang's router has them)
    load_balance_method: str = _flag(
        "cache_aware", "how a request's scheduler is picked: cache_aware (where its prefix is "
        "cached, unless load is imbalanced), round_robin, shortest_queue, or random (NATS's "
        "queue group)", choices=["cache_aware", "round_robin", "shortest_queue", "random"])
    cache_threshold: float = _flag(0.3, "cache_aware: share of the prompt a scheduler must "
                                   "hold cached to be picked for it")
    balance_abs_threshold: int = _flag(64, "cache_aware: load (running + waiting) is imbalanced "
                                       "when max - min exceeds this...")
    balance_rel_threshold: float = _flag(1.5, "...and max exceeds min times this")
    grammar_backend: str = _flag("xgrammar", "structured outputs (JSON schema, regex, choice, "
                                 "EBNF, tool calls) are decoded under this grammar backend",
                                 choices=["xgrammar"])
    grammar_compile_timeout: float = _flag(10.0, "seconds a request's grammar may take to "
                                           "compile before the request fails with a 400")
    # gateway
    api_key: str | None = _flag(None, "require 'Authorization: Bearer KEY'")
    admin_api_key: str | None = _flag(None, "the only key that opens /abort_request, "
                                      "/flush_cache and other routes that change server state "
                                      "(generation takes either key)")
    enable_metrics: bool = _flag(True, "serve /metrics", negatable=True)
    max_request_bytes: int = _flag(8 * 1024 * 1024, "largest request body (413 beyond)")
    first_output_timeout: float = _flag(600.0, "seconds to the first output before an error")
    inter_output_timeout: float = _flag(120.0, "seconds between outputs before an error")
    heartbeat_timeout: float = _flag(5.0, "a service silent this long counts as dead")
    max_stop_strings: int = _flag(16, "most stop strings per request")
    tool_call_parser: str = _flag("xlam", "the model's tool-call format, rendered into the "
                                  "prompt and parsed from its output: xlam (SmolLM2: a JSON list "
                                  "in <tool_call>...</tool_call>) or hermes (Qwen, Hermes: one "
                                  "JSON object per <tool_call> tag)", choices=["xlam", "hermes"])
    # observability
    otlp_traces_endpoint: str | None = _flag(None, "OTLP traces endpoint (http(s):// or grpc://)")
    otlp_traces_protocol: str = _flag("http/protobuf", "http/protobuf or grpc",
                                      choices=["http/protobuf", "grpc"])
    log_level: str = _flag("info", "debug, info, warning or error",
                           choices=["debug", "info", "warning", "error"])
    stats_interval: float = _flag(1.0, "seconds between heartbeats")
    log_stats_interval: float = _flag(5.0, "seconds between the scheduler's stats log lines")
    health_file: str | None = _flag(None, "touch this file after each heartbeat sent "
                                    "(container health checks: python -m common.health)")

    def resolved_instance_id(self, service: str) -> str:
        if self.instance_id:
            return self.instance_id
        return f"{service}-{uuid.uuid4().hex[:8]}"


def _env_name(name: str) -> str:
    return "TOKENLINE_" + name.upper()


def _parse_bool(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def check_device(value: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    head, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not auto, cpu, cuda or cuda:N")


def parse_cpu_list(value: str) -> list[int]:
    """`0-1,4` -> [0, 1, 4]: cores, each one this process may run on."""
    cores: set[int] = set()
    try:
        for part in value.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not auto, none or a core list such as 0-1 or 0,2,4-5") from None
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise argparse.ArgumentTypeError(
            f"core {min(cores - allowed)} is not one this process may run on "
            f"({format_cpu_list(sorted(allowed))})")
    return sorted(cores)


def format_cpu_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> `0-2,5`."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def check_cpu_list(value: str) -> str:
    """none, auto, or a core list (checked against this process's affinity)."""
    if value in ("none", "auto"):
        return value
    parse_cpu_list(value)
    return value


_CHECKS = {"device": check_device, "cpu_list": check_cpu_list}
_KINDS = {"int": int, "float": float, "int | None": int, "float | None": float}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        aliases = meta.pop("aliases", ())
        negatable = meta.pop("negatable", False)
        # empty counts as unset, as compose's `${TOKENLINE_X:-}` leaves it
        env = os.environ.get(_env_name(f.name)) or None
        if f.type in ("bool", bool):
            default = _parse_bool(env) if env is not None else f.default
            action = argparse.BooleanOptionalAction if negatable else "store_true"
            parser.add_argument(flag, action=action, default=default, help=help_text)
            continue
        check = meta.pop("type", None)
        kind = _CHECKS[check] if check else _KINDS.get(str(f.type), str)
        default = f.default
        if env is not None:
            try:  # a list flag's variable holds its values separated by spaces
                default = [kind(v) for v in env.split()] if "nargs" in meta else kind(env)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                why = f"expected {'an' if kind is int else 'a'} {kind.__name__}" if kind in (
                    int, float) else str(exc)
                parser.error(f"{_env_name(f.name)}={env!r}: {why}")
            if "choices" in meta and default not in meta["choices"]:
                parser.error(f"{_env_name(f.name)}={env!r}: choose from "
                             + ", ".join(map(str, meta["choices"])))
        parser.add_argument(flag, *aliases, type=kind, default=default, help=help_text, **meta)


def server_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of every service and of `tokenline serve` (its defaults read from
    `TOKENLINE_<FLAG>` as they stand now)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_server_args(parser)
    return parser


def parse_server_args(argv: list[str] | None = None, prog: str | None = None) -> ServerArgs:
    parser = server_parser(prog)
    args = ServerArgs(**vars(parser.parse_args(argv)))
    if (error := speculative_error(args)) is not None:
        parser.error(error)
    return args


def speculative_error(args: ServerArgs) -> str | None:
    """What is wrong with the speculative flags together, naming the flag (None: nothing)."""
    k = args.speculative_num_draft_tokens
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if k is not None and not 1 <= k <= 64:
        return f"--speculative-num-draft-tokens must be in [1, 64], not {k}"
    draft = args.speculative_draft_model_path
    if args.speculative_algorithm == "STANDALONE" and not draft:
        return "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"
    if draft and args.speculative_algorithm != "STANDALONE":
        return ("--speculative-draft-model-path is for --speculative-algorithm STANDALONE, not "
                f"{args.speculative_algorithm or 'no speculation'}")
    if (error := _draft_layers_error(args)) is not None:
        return error
    if not 1 <= lo <= hi:
        return ("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                f"--speculative-ngram-max-match-window-size, not {lo} and {hi}")
    if (error := lora_error(args)) is not None:
        return error
    if args.speculative_disable_by_batch_size is not None and \
            args.speculative_disable_by_batch_size < 1:
        return ("--speculative-disable-by-batch-size must be >= 1, not "
                f"{args.speculative_disable_by_batch_size}")
    return None


def _draft_layers_error(args: ServerArgs) -> str | None:
    """--speculative-draft-layers goes with SELF, and SELF with it or with a quantized draft
    (its upper bound, the model's layer count, is checked where the model is loaded)."""
    layers = args.speculative_draft_layers
    quantized = args.speculative_draft_model_quantization not in (None, "none")
    if args.speculative_draft_model_quantization is not None and (
        args.speculative_algorithm not in ("STANDALONE", "SELF")
    ):
        return ("--speculative-draft-model-quantization is for --speculative-algorithm "
                f"STANDALONE or SELF, not {args.speculative_algorithm or 'no speculation'}")
    if args.speculative_algorithm == "SELF" and layers is None and not quantized:
        return ("--speculative-algorithm SELF needs --speculative-draft-layers (or a "
                "quantized draft, --speculative-draft-model-quantization)")
    if args.speculative_algorithm == "SELF" and quantized and (
        args.speculative_draft_model_quantization == args.quantization
    ):
        return (f"--speculative-draft-model-quantization {args.quantization} is the target's "
                "own --quantization: SELF's draft would be the target's own weights, leave it "
                "unset")
    if layers is not None and args.speculative_algorithm != "SELF":
        return ("--speculative-draft-layers is for --speculative-algorithm SELF, not "
                f"{args.speculative_algorithm or 'no speculation'}")
    if layers is not None and layers < 1:
        return f"--speculative-draft-layers must be >= 1, not {layers}"
    return None


def lora_paths(args: ServerArgs) -> dict[str, str]:
    """--lora-paths as name -> directory (a ValueError naming a malformed entry)."""
    out: dict[str, str] = {}
    for entry in args.lora_paths or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-paths: {entry!r} is not name=path")
        if name in out:
            raise ValueError(f"--lora-paths: adapter name {name!r} given twice")
        out[name] = path
    return out


def lora_error(args: ServerArgs) -> str | None:
    """What is wrong with the LoRA flags, naming the flag (None: nothing)."""
    try:
        names = lora_paths(args)
    except ValueError as e:
        return str(e)
    if args.max_loras_per_batch < 1:
        return f"--max-loras-per-batch must be >= 1, not {args.max_loras_per_batch}"
    if args.max_lora_rank < 1:
        return f"--max-lora-rank must be >= 1, not {args.max_lora_rank}"
    served = args.served_model_name
    if served is not None and served in names:
        return f"--lora-paths: adapter name {served!r} is the base model's name"
    return None


def to_argv(args: ServerArgs) -> list[str]:
    """Flags that reproduce `args` (for the launcher's children)."""
    out: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif f.metadata.get("negatable"):
                out.append("--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
