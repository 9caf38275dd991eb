"""vLLM's vocabulary for a scenario: its engine-argument names, and its command-line flags.

A team that runs vLLM can write its settings the way it launches the server:

- in ``engine:``, vLLM's engine-argument names (snake or kebab case) for what llmsim
  models: ``max_num_batched_tokens``, ``enable_chunked_prefill``, ``gpu_memory_utilization``...
- ``engine.vllm_args: "--max-num-seqs 256 --max-num-batched-tokens 8192 -tp 4"`` (or
  ``llmsim run --vllm-args "..."``): the flags of ``vllm serve``, each mapped to its llmsim
  setting (:data:`VLLM_ARGS`). Flags llmsim does not model are listed, with why, in the
  scenario's ``vllm_notes`` (printed with the run); a flag whose value cannot be read, or
  a setting given both as a flag and as a key, is a ConfigError.

Either way the scenario uses vLLM's defaults where llmsim's differ (:data:`VLLM_DEFAULTS`,
from vLLM's EngineArgs: 16-token blocks, prefix caching on): ``engine.defaults: vllm`` says so alone.
"""
from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Callable

from llmsim.config.limits import MAX_FLAGS_CHARS, MAX_NUMBER
from llmsim.config.reader import Node, range_text

# vLLM's defaults where llmsim's differ (vllm/engine/arg_utils.py, the V1 engine: block_size 16 on CUDA,
# automatic prefix caching on). Prefix caching only with continuous batching (vLLM has no other).
VLLM_DEFAULTS = {"block_size": 16, "prefix_caching": True}
DEFAULTS = ("llmsim", "vllm")

# A flag's value is read as plain ASCII text: int() and float() would also take digit separators
# ("1_000"), other scripts' digits, "nan" and "inf".
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# A flag's name, and a word argparse takes as a (negative number) value rather than as a flag.
_FLAG = re.compile(r"(--?)([A-Za-z][A-Za-z0-9_-]*)(?:=(.*))?", re.DOTALL)
_NEGATIVE_NUMBER = re.compile(r"-[0-9]+|-[0-9]*\.[0-9]+")


def _count(text: str) -> int:
    """A whole number >= 1 (sequences, tokens, ranks), at most the magnitude every number keeps."""
    if not _INTEGER_TEXT.fullmatch(text) or not 1 <= int(text) <= MAX_NUMBER:
        raise ValueError(text)
    return int(text)


def _fraction(text: str) -> float:
    """A share of the device's memory, 0 to 1."""
    if not _NUMBER_TEXT.fullmatch(text) or not 0.0 <= float(text) <= 1.0:
        raise ValueError(text)
    return float(text)


def _boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return lowered in ("true", "1")


def _kv_dtype(text: str) -> str | None:
    return {"auto": None, "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bfloat16": "bf16",
            "float16": "fp16"}[text]


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(text)
        return text
    return parse


def _quantization(text: str) -> str:
    return {"fp8": "fp8"}[text]


def _policy(text: str) -> str:
    return {"fcfs": "fcfs", "priority": "vllm_priority"}[text]


_COUNT = range_text("an integer", 1, MAX_NUMBER)
# vLLM argument (snake case) -> (llmsim key path, parse the flag's text, what vLLM accepts).
VLLM_ARGS: dict[str, tuple[str, Callable[[str], object], str]] = {
    "max_num_seqs": ("engine.max_num_seqs", _count, _COUNT),
    "max_num_batched_tokens": ("engine.max_batch_tokens", _count, _COUNT),
    "enable_chunked_prefill": ("engine.chunked_prefill", _boolean, "true, false (or the bare flag)"),
    "enable_prefix_caching": ("engine.prefix_caching", _boolean, "true, false (or the bare flag)"),
    "async_scheduling": ("engine.async_scheduling", _boolean, "true, false (or the bare flag)"),
    "preemption_mode": ("engine.preemption_mode", _choice("recompute", "swap"), "recompute, swap"),
    "block_size": ("engine.block_size", _count, _COUNT),
    "gpu_memory_utilization": ("engine.memory_utilization", _fraction, "a fraction from 0 to 1, e.g. 0.9"),
    "max_model_len": ("engine.max_model_len", _count, _COUNT),
    "tensor_parallel_size": ("deployment.tensor_parallel", _count, _COUNT),
    "pipeline_parallel_size": ("deployment.pipeline_parallel", _count, _COUNT),
    "data_parallel_size": ("deployment.replicas", _count, _COUNT),
    "kv_cache_dtype": ("model.kv_dtype", _kv_dtype, "auto, fp8, fp8_e4m3, fp8_e5m2"),
    "quantization": ("model.weight_dtype", _quantization, "fp8 (other methods need a quantized checkpoint: "
                                                          "give its config.json)"),
    "scheduling_policy": ("engine.scheduling_policy", _policy, "fcfs, priority (llmsim's vllm_priority: it "
                                                                  "orders the workload's traffic classes)"),
}
SHORT_FLAGS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size",
               "q": "quantization"}
# Flags that change performance in ways llmsim does not model (said with the run).
NOT_MODELLED = {
    "enforce_eager": "CUDA graphs are not modelled (the cost model is calibrated per profile)",
    "swap_space": "swapped blocks go to the hardware profile's host memory, whatever its size here",
    "cpu_offload_gb": "weight offload to CPU memory is not modelled",
    "num_scheduler_steps": "multi-step scheduling is not modelled",
    "speculative_config": "give speculative decoding in the scenario's speculation section",
    "enable_expert_parallel": "expert parallelism is not modelled (experts are split by tensor parallelism)",
    "max_num_partial_prefills": "partial-prefill concurrency limits are not modelled",
    "long_prefill_token_threshold": "long-prefill thresholds are not modelled",
    "compilation_config": "compilation settings are not modelled",
    "disable_custom_all_reduce": "all-reduce kernels are not modelled separately",
    "kv_transfer_config": "disaggregated prefill/decode is not modelled",
    "max_seq_len_to_capture": "CUDA graphs are not modelled",
    "dtype": "llmsim takes the model's own dtypes (model.weight_dtype, kv_dtype change them)",
}
NOT_MODELLED_VALUES: dict[tuple[str, str], str] = {}    # (flag, value) pairs not modelled, with why
# Flags with no effect on serving performance: accepted, and listed as such.
NO_EFFECT = ("host", "port", "served_model_name", "trust_remote_code", "api_key", "disable_log_requests",
             "disable_log_stats", "uvicorn_log_level", "tokenizer", "tokenizer_mode", "download_dir", "seed",
             "revision", "chat_template", "max_logprobs", "generation_config", "model", "load_format",
             "enable_log_requests", "disable_uvicorn_access_log", "ssl_keyfile", "ssl_certfile",
             "allowed_origins", "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser",
             "hf_token", "root_path", "middleware", "config_format")
FLAGS_WITHOUT_VALUE = ("enable_chunked_prefill", "enforce_eager", "enable_prefix_caching", "trust_remote_code",
                       "disable_log_requests", "disable_log_stats", "enable_expert_parallel", "async_scheduling",
                       "disable_custom_all_reduce", "enable_log_requests", "disable_uvicorn_access_log",
                       "enable_auto_tool_choice")
# engine-section aliases: vLLM's name -> llmsim's engine key (where they differ).
ENGINE_ALIASES = {name: target.split(".", 1)[1] for name, (target, _, _) in VLLM_ARGS.items()
                  if target.startswith("engine.") and target.split(".", 1)[1] != name}


COMMAND_LINE_FLAG = "--vllm-args"        # where flags given on the command line come from, in errors


def apply_vllm_vocabulary(root: Node, command_line: str | None = None) -> tuple[str, ...]:
    """Rewrite ``root``'s engine section into llmsim's keys (vLLM aliases, ``vllm_args``) and
    fill vLLM's defaults where asked; returns the notes on flags not modelled. ``root.data`` is
    replaced by a rewritten copy (the caller's mapping is left as it was).

    ``command_line``: flags given on the command line (``--vllm-args``), applied last; unlike the
    file's own flags, which may not contradict its keys, they override what the file sets."""
    if command_line is not None and root.data.get("engine") is None:
        root.data = {**root.data, "engine": {}}
    engine = root.data.get("engine")
    if not isinstance(engine, dict):
        return ()
    root.data = data = copy.deepcopy(root.data)
    engine = data["engine"]
    eng = Node(engine, file=root.file, path="engine")
    notes: list[str] = []
    for key in list(engine):
        name = str(key).replace("-", "_")
        target = ENGINE_ALIASES.get(name, name if name != key else None)
        if target is None:
            continue
        if target in engine and target != key:
            raise eng.key_error(str(key), f"sets {target} a second time", engine[key], f"one of {key}, {target}")
        engine[target] = engine.pop(key)
    flags = engine.pop("vllm_args", None)
    defaults = engine.pop("defaults", "llmsim" if flags is None and command_line is None else "vllm")
    if defaults not in DEFAULTS:
        raise eng.key_error("defaults", "unknown defaults", defaults, ", ".join(DEFAULTS))
    if flags is not None:
        notes = _apply_flags(flags, data, eng, "vllm_args")
    if command_line is not None:
        notes += _apply_flags(command_line, data, Node({COMMAND_LINE_FLAG: command_line}), COMMAND_LINE_FLAG,
                              override=True)
    if defaults == "vllm":
        for key, value in VLLM_DEFAULTS.items():
            if key != "prefix_caching" or engine.get("batching", "continuous") == "continuous":
                engine.setdefault(key, value)
    return tuple(notes)


def refuse_unmodelled(engine: Node) -> None:
    """Before ``engine.done()``: a vLLM setting llmsim does not model, left unread in the engine
    section, is a ConfigError that says so (rather than only "unknown key")."""
    for key in engine.unread():
        name = str(key).replace("-", "_")
        if name in NOT_MODELLED:
            raise engine.key_error(str(key), f"vLLM's {name} is not modelled by llmsim ({NOT_MODELLED[name]})",
                                   engine.data[key], "remove it; docs/guides/vllm.md lists what is modelled")


def parse_vllm_args(text: str) -> list[tuple[str, str | None, str]]:
    """``vllm serve`` flags as (name in snake case, value or None, the flag as written); the
    leading ``vllm serve MODEL`` and the model argument are skipped. A word that is neither a flag
    nor a flag's value, or a flag written ``--name=`` with nothing after it, is a ValueError."""
    words = shlex.split(text)
    if words[:2] == ["vllm", "serve"]:
        words = words[2:]
    if words and not words[0].startswith("-"):
        words = words[1:]                   # the model
    parsed, i = [], 0
    while i < len(words):
        word = words[i]
        match = _FLAG.fullmatch(word)
        if match is None:
            raise ValueError(f"{word!r} is not a flag" if word.startswith("-") else f"{word!r} follows no flag")
        flag, inline = match.group(2), match.group(3)
        if inline == "":
            raise ValueError(f"{word} has no value after '='")
        name = SHORT_FLAGS.get(flag, flag.replace("-", "_"))
        negated = name.startswith("no_") and name[3:] in FLAGS_WITHOUT_VALUE
        if inline is not None:
            value = inline
        elif negated or i + 1 >= len(words) or (words[i + 1].startswith("-")
                                                 and not _NEGATIVE_NUMBER.fullmatch(words[i + 1])):
            value = "false" if negated else None
        else:
            i += 1
            value = words[i]
        parsed.append((name[3:] if negated else name, value, match.group(1) + flag))
        i += 1
    return parsed


def _apply_flags(text: object, data: dict, eng: Node, key: str, *, override: bool = False) -> list[str]:
    """Set the scenario keys that the flags ``text`` (read from ``key`` of ``eng``) name; the notes on
    flags not modelled. ``override``: a flag replaces a value the scenario sets (else that is an error)."""
    if not isinstance(text, str):
        raise eng.key_error(key, "expected the flags as one string", text,
                            "e.g. \"--max-num-seqs 256 --max-num-batched-tokens 8192\"")
    if len(text) > MAX_FLAGS_CHARS:
        raise eng.key_error(key, f"longer than the {MAX_FLAGS_CHARS:,} characters llmsim reads as flags", text,
                            f"vLLM serve flags, at most {MAX_FLAGS_CHARS:,} characters")
    try:
        flags = parse_vllm_args(text)
    except ValueError as exc:
        raise eng.key_error(key, f"cannot read these flags ({exc})", text, "vLLM serve flags") from None
    notes = []
    for name, value, written in flags:
        not_modelled = NOT_MODELLED_VALUES.get((name, value)) if value is not None else None
        if not_modelled is not None:
            notes.append(f"{written} {value} not modelled: {not_modelled}")
        elif name in VLLM_ARGS:
            target, parse, allowed = VLLM_ARGS[name]
            text_value = "true" if value is None and name in FLAGS_WITHOUT_VALUE else value
            try:
                if text_value is None:
                    raise ValueError("no value")
                parsed = parse(text_value)
            except (ValueError, KeyError):
                raise eng.key_error(key, f"cannot read {written} {value or ''}".rstrip(), text,
                                    f"{written}: {allowed}") from None
            if parsed is not None:
                note = _set(data, target, parsed, written, eng, key, text, override)
                if note:
                    notes.append(note)
        elif name in NOT_MODELLED:
            notes.append(f"{written} not modelled: {NOT_MODELLED[name]}")
        elif name in NO_EFFECT:
            notes.append(f"{written} ignored: no effect on serving performance")
        else:
            notes.append(f"{written} not modelled: not a flag llmsim knows")
    return notes


def _set(data: dict, path: str, value: object, written: str, eng: Node, flags_key: str, flags: str,
         override: bool) -> str | None:
    """Set ``path`` (section.key) to a flag's ``value``; with ``override``, over the scenario's own value
    (the note returned says so)."""
    section, key = path.split(".")
    if section == "model":
        _model_mapping(data, path, written, eng, flags_key, flags)
    if data.get(section) is None:
        data[section] = {}
    mapping = data[section]
    if not isinstance(mapping, dict):
        raise eng.key_error(flags_key, f"{written} sets {path}, but {section} is not a mapping", mapping)
    if key in mapping and not override:
        if mapping[key] != value:
            raise eng.key_error(flags_key, f"{written} sets {path} to {value!r}, which the scenario sets to "
                                f"{mapping[key]!r}", value, "one of them")
        return None         # the same value: the scenario's own, which its key's check reads (1 is not true)
    note = (f"{written} overrides the scenario's {path}: {mapping[key]!r} -> {value!r}"
            if key in mapping and mapping[key] != value else None)
    mapping[key] = value
    return note


def _model_mapping(data: dict, path: str, written: str, eng: Node, flags_key: str, flags: str) -> None:
    """The scenario's model as a mapping that a flag can add a setting to (a catalog name becomes
    ``base``, a config.json path ``config_json``)."""
    model = data.get("model")
    if model is None:
        raise eng.key_error(flags_key, f"{written} sets {path}, but the scenario names no model", flags,
                            "model: a catalog name, a config.json path or the model's fields")
    if isinstance(model, str) and model.endswith((".yaml", ".yml")):
        raise eng.key_error(flags_key, f"{written} sets {path}, which the model file {model} sets itself", flags,
                            f"{path.split('.')[1]} in {model}, or the model named by catalog name or config.json")
    if isinstance(model, str):
        data["model"] = {"config_json": model} if model.endswith(".json") else {"base": model}
    elif not isinstance(model, dict):
        raise eng.error("expected a model", key="model", value=model,
                        allowed="a catalog name, a config.json or model YAML path, or a mapping of the model's fields")
