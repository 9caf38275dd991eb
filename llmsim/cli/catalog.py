"""``llmsim place``, ``llmsim models`` and ``llmsim hardware``: the catalog, and what fits where."""
from __future__ import annotations

import pandas as pd

from llmsim.catalog.hardware import hardware_catalog, lookup_hardware
from llmsim.catalog.models import DTYPE_BYTES, lookup_model, model_catalog
from llmsim.catalog.placement import Placement, place, smallest_fitting
from llmsim.cli.options import integer_flag, number_flag
from llmsim.config.limits import MAX_QUANTITY
from llmsim.cost.experts import ExpertParallel, layout_problem, weight_bytes_per_device
from llmsim.config.words import counted
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import ENGINE

CONTEXTS = (2048, 8192, 32768)      # the context lengths place reports by default


def configure_place(placed) -> None:
    placed.add_argument("model", help="a model of the catalog (llmsim models lists them)")
    placed.add_argument("hardware", help="a hardware profile's name or alias (llmsim hardware), or its file")
    placed.add_argument("--weight-dtype", choices=list(DTYPE_BYTES), default=None,
                        help="the weights' data type (default: the model's own)")
    placed.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), default=None,
                        help="the KV cache's data type (default: the model's own)")
    placed.add_argument("--tp", type=integer_flag(1), help="fix tensor parallelism: it must divide the model's "
                        "attention heads (default: search)")
    placed.add_argument("--pp", type=integer_flag(1), help="fix pipeline stages, at most the model's layers "
                        "(default: search)")
    placed.add_argument("--memory-utilization", type=number_flag(0.0, 1.0, exclusive_minimum=True),
                        default=ENGINE.memory_utilization, help="fraction of device memory llmsim may use, in (0, 1]")
    placed.add_argument("--max-batch-tokens", type=integer_flag(1), default=ENGINE.max_batch_tokens,
                        help="tokens of one iteration, whose activations must fit beside the weights "
                             f"(default {ENGINE.max_batch_tokens:,})")
    placed.add_argument("--runtime-reserve-gb", type=number_flag(0.0, MAX_QUANTITY["bytes"] / 1e9),
                        default=ENGINE.runtime_reserve_bytes / 1e9,
                        help="memory per device the runtime keeps for itself: CUDA context, graphs, workspace "
                             f"(default {ENGINE.runtime_reserve_bytes / 1e9:.3g})")
    placed.add_argument("--context", type=integer_flag(1), nargs="+",
                        help="context lengths to report concurrency for, 1 up to the model's context (default: "
                        f"{', '.join(map(str, CONTEXTS))}, those the model holds)")
    placed.add_argument("--ep", type=integer_flag(2), help="spread the routed experts of an MoE model over this many "
                        "GPUs (expert parallelism, a multiple of --tp, default 1: attention data parallel over "
                        "ep / tp ranks); weights and KV cache per GPU of the group")
    placed.add_argument("--redundant-experts", type=integer_flag(0), default=0,
                        help="with --ep: extra expert slots for copies of the hottest experts (EPLB)")
    placed.add_argument("--room-for", type=integer_flag(1), default=1,
                        help="when searching, require KV room for at least this many tokens")
    placed.set_defaults(func=_cmd_place)


def configure_models(parser) -> None:
    parser.set_defaults(func=_cmd_models)


def configure_hardware(parser) -> None:
    parser.set_defaults(func=_cmd_hardware)


def _cmd_place(args) -> int:
    model = lookup_model(args.model, model_catalog()).with_dtypes(args.weight_dtype, args.kv_dtype)
    hardware = lookup_hardware(args.hardware)
    _check_place_flags(args, model)
    reserve = args.runtime_reserve_gb * 1e9
    placement: Placement | None
    if args.ep:
        args.tp, args.pp = args.tp or 1, args.pp or 1
        layout = ExpertParallel(args.ep, args.redundant_experts)
        placement = place(model, hardware, args.tp, args.pp, args.memory_utilization, ENGINE.block_size,
                          args.max_batch_tokens, reserve,
                          weights_per_device_bytes=weight_bytes_per_device(model, args.tp, args.pp, layout))
        if not placement.fits:
            raise ConfigError(f"{model.name} does not fit on an expert-parallel group of {args.ep} x {hardware.name}: "
                              f"{placement.weights_per_device_bytes / 1e9:.1f} GB of weights per GPU "
                              f"({layout.experts_per_rank(model)} experts each), "
                              f"{placement.usable_per_device_bytes / 1e9:.1f} GB usable", key="--ep", value=args.ep,
                              allowed="a larger --ep, more --pp stages, fewer --redundant-experts or a larger device")
    elif args.tp and args.pp:
        placement = place(model, hardware, args.tp, args.pp, args.memory_utilization, ENGINE.block_size,
                          args.max_batch_tokens, reserve)
    else:
        placement = smallest_fitting(model, hardware, args.memory_utilization, ENGINE.block_size,
                                     args.max_batch_tokens, reserve, args.tp, args.pp, min_kv_tokens=args.room_for)
    if placement is None or not placement.fits:
        raise _does_not_fit(args, model, hardware, reserve)
    p = placement
    others = "".join(f", {dtype} {part}" for part, dtype in (("experts", model.expert_dtype),
                                                             ("embeddings", model.embedding_dtype)) if dtype)
    print(f"{model.name} ({model.weight_dtype} weights{others}, {model.kv_dtype} KV) on {hardware.name}:")
    print(f"  devices            {p.devices} (tensor parallel {p.tensor_parallel} x pipeline stages "
          f"{p.pipeline_parallel})")
    if args.ep:
        per_gpu = ExpertParallel(args.ep, args.redundant_experts).experts_per_rank(model)
        print(f"  expert parallel    {args.ep} GPUs per group, {per_gpu} experts per GPU; attention data parallel "
              f"over {args.ep // args.tp} ranks (KV cache per rank below)")
    print(f"  weights            {p.weights_per_device_bytes / 1e9:,.2f} GB per device in {p.weight_tier.name}"
          + (" (streamed every iteration)" if p.weight_streaming else ""))
    print(f"  KV cache           {p.kv_per_device_bytes / 1e9:,.2f} GB per device in {p.kv_tier.name}"
          f" = {p.kv_capacity_tokens:,} tokens per replica")
    for context in args.context:
        print(f"  concurrency        {counted(p.concurrent_sequences(context), 'sequence')} of {context:,} tokens")
    return 0


def _does_not_fit(args, model, hardware, reserve: float) -> ConfigError:
    """Nothing fits as asked: an error naming what was asked (the fixed layout, else the KV room) and the
    smallest layout that holds the model with room for one token, or that none does on this chip."""
    asked = []
    if args.tp or args.pp:
        key, value = ("--tp", args.tp) if args.tp else ("--pp", args.pp)
        asked.append(f"tensor parallel {args.tp or 'any'} x pipeline stages {args.pp or 'any'}")
    else:
        key, value = ("--room-for", args.room_for) if args.room_for > 1 else ("hardware", hardware.name)
    if args.room_for > 1:
        asked.append(f"KV room for {args.room_for:,} tokens")
    smallest = smallest_fitting(model, hardware, args.memory_utilization, ENGINE.block_size, args.max_batch_tokens,
                                reserve)
    message = (f"{model.name} ({model.weight_dtype} weights) does not fit on {hardware.name}"
               + (f" with {' and '.join(asked)}" if asked else ""))
    if smallest is None:
        return ConfigError(f"{message}: no layout of {hardware.name} devices holds it (tensor parallel dividing its "
                           f"{model.num_heads} heads x up to {model.num_layers} pipeline stages), its weights and "
                           f"the activations of --max-batch-tokens {args.max_batch_tokens:,} in the "
                           f"{hardware.memory_name} of each", key=key, value=value,
                           allowed="a smaller --weight-dtype or --max-batch-tokens, a smaller --runtime-reserve-gb, "
                                   "or a larger device")
    return ConfigError(message, key=key, value=value,
                       allowed=f"the smallest layout that holds the model: {smallest.devices} x {hardware.name} "
                               f"(tensor parallel {smallest.tensor_parallel} x pipeline stages "
                               f"{smallest.pipeline_parallel}), KV room for {smallest.kv_capacity_tokens:,} tokens")


def _check_place_flags(args, model) -> None:
    """The rules a scenario's deployment keys follow (tp divides the heads, pp at most the layers),
    and contexts the model can hold."""
    if args.tp is not None and model.num_heads % args.tp:
        divisors = ", ".join(str(d) for d in range(1, model.num_heads + 1) if model.num_heads % d == 0)
        raise ConfigError(f"must divide {model.name}'s {model.num_heads} attention heads", key="--tp",
                          value=args.tp, allowed=divisors)
    if args.pp is not None and args.pp > model.num_layers:
        raise ConfigError(f"cannot exceed {model.name}'s {model.num_layers} layers", key="--pp", value=args.pp,
                          allowed=f"1..{model.num_layers}")
    if args.ep is None and args.redundant_experts:
        raise ConfigError("redundant experts need expert parallelism", key="--redundant-experts",
                          value=args.redundant_experts, allowed="0, or with --ep")
    if args.ep is not None:
        problem = layout_problem(model, args.ep, args.tp or 1, args.redundant_experts)
        if problem is not None:
            raise ConfigError(problem[0], key="--ep", value=args.ep, allowed=problem[1])
    if args.context is None:
        args.context = [c for c in CONTEXTS if c <= model.max_context] or [model.max_context]
    longer = [context for context in args.context if context > model.max_context]
    if longer:
        raise ConfigError(f"longer than {model.name}'s context of {model.max_context:,} tokens", key="--context",
                          value=longer[0], allowed=f"1..{model.max_context}")


def _cmd_models(args) -> int:
    rows = [{"model": m.name, "params_B": round(m.param_count / 1e9, 3),
             "active_B": round(m.active_param_count / 1e9, 3), "layers": m.num_layers,
             "hidden": m.hidden_size, "heads/kv": f"{m.num_heads}/{m.num_kv_heads}",
             "kv_KiB_per_token": round(m.kv_bytes_per_token / 1024, 1), "max_context": m.max_context}
            for m in model_catalog().values()]
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


def _cmd_hardware(args) -> int:
    rows = [{"hardware": h.name, "bf16 TFLOP/s": h.peak_for("bf16") / 1e12, "memory GB": h.memory_capacity_bytes / 1e9,
             "TB/s": h.memory_bandwidth_bytes_per_s / 1e12, "link GB/s": h.interconnect_bandwidth_bytes_per_s / 1e9,
             "TDP W": h.tdp_w, "USD/h": h.price_per_hour_usd, "also named": ", ".join(h.aliases)}
            for h in hardware_catalog().values()]
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"))
    for profile in hardware_catalog().values():
        if profile.machine is not None:
            print(f"{profile.name}: measured on {profile.machine} (llmsim calibrate); calibrate your own machine")
    return 0
