"""What each scenario key means: the descriptions of the generated scenario reference.

The reader (``scenario.py`` and the readers it calls) owns each key's type, default, unit and
allowed values; ``llmsim.cli.reference`` records them as scenarios load and takes the words from
:data:`KEY_HELP` here, keyed by the key's path (``<name>`` for a name the user chooses). A key the
reader takes without an entry here fails ``tests/test_docs.py``, and so does an entry for a key the
reader never takes.
"""
from __future__ import annotations

# Mappings whose keys are names the user chooses (traffic classes, rollout groups).
NAMED = ("workload.classes", "slo.classes", "rollout.groups")
# Keys that hold a length (a number of tokens or turns, or a distribution): their keys are documented once,
# as `<length>.KEY`.
LENGTHS = ("workload.prompt_tokens", "workload.output_tokens", "workload.sessions.turns",
           "workload.classes.<name>.prompt_tokens", "workload.classes.<name>.output_tokens")

# Keys that pick a variant: the keys read after them depend on their value.
VARIANT_KEYS = ("distribution", "process", "rule", "role")

# Scenarios that between them set every section and every variant, each laid over the shipped chat
# scenario (a section named in REPLACED is replaced whole). "{tmp}/" is a folder the generator fills with
# the small files some of them read (a config.json, a dataset, measured acceptance lengths).
REPLACED = ("prompt_tokens", "output_tokens", "arrival", "model", "acceptance", "draft")
COVERAGE = (
    {"workload": {"prompt_tokens": {"distribution": "uniform", "low": 100, "high": 900, "min": 1},
                  "output_tokens": {"distribution": "exponential", "mean": 200, "max": 1000}}},
    {"workload": {"prompt_tokens": {"distribution": "fixed", "value": 512},
                  "output_tokens": {"distribution": "empirical", "path": "traces/synthetic-burst.csv"}}},
    {"workload": {"arrival": {"process": "gamma", "rate": "8/s", "cv": 2}}},
    {"workload": {"arrival": {"process": "deterministic", "rate": "8/s"}, "num_requests": None,
                  "duration": "2 min"}},
    {"workload": {"arrival": {"process": "diurnal", "rate": "8/s", "amplitude": 0.5, "period": "10 min",
                              "peak": "5 min"}}},
    {"workload": {"arrival": {"process": "steps", "rates": [{"at": "0 s", "rate": "5/s"},
                                                           {"at": "1 min", "rate": "10/s"}]}}},
    {"workload": {"arrival": {"process": "ramp", "rates": [{"at": "0 s", "rate": "5/s"},
                                                          {"at": "1 min", "rate": "10/s"}]}}},
    {"workload": {"arrival": {"process": "mmpp", "states": [{"rate": "5/s", "mean_duration": "60 s"},
                                                           {"rate": "20/s", "mean_duration": "5 s"}]}}},
    {"workload": {"arrival": {"process": "trace", "path": "traces/burstgpt-sample.csv", "format": "burstgpt",
                              "window": {"start": "0 s", "end": "10 min"},
                              "filter": {"model": "ChatGPT", "log_type": ["API log", "Conversation log"]},
                              "sample": 0.5, "rate": "4/s", "failed": "replay"},
                  "num_requests": None, "prompt_tokens": None, "output_tokens": None}},
    {"workload": {"arrival": {"process": "trace", "path": "traces/synthetic-burst.csv", "speed": 2},
                  "num_requests": None, "prompt_tokens": None, "output_tokens": None}},
    {"workload": {"arrival": {"process": "poisson", "rate": "4/s"}, "num_requests": 100,
                  "prompt_tokens": None, "output_tokens": None,
                  "dataset": {"path": "{tmp}/dataset.json", "format": "sharegpt", "chars_per_token": 4}}},
    {"workload": {"sessions": {"turns": {"distribution": "uniform", "low": 1, "high": 4}, "think_time": "10 s",
                               "system_prompt": {"tokens": 500, "share": 0.8, "variants": 2}}},
     "engine": {"prefix_caching": True, "preemption_mode": "swap",
                "cpu_offload": {"idle_timeout": "2 s", "overlap": True, "capacity": "100 GB"}},
     "deployment": {"router": "prefix_aware", "load_bound": 1.5, "replicas": 2}},
    {"workload": {"classes": {"chat": {"arrival": {"process": "poisson", "rate": "4/s"}, "priority": 0,
                                       "prompt_tokens": 256, "output_tokens": 64, "queue_timeout": "50 ms",
                                       "on_timeout": "dedicated", "dedicated_seqs": 4},
                              "bulk": {"arrival": {"process": "poisson", "rate": "2/s"}, "weight": 2,
                                       "reserved_seqs": 8}},
                  "arrival": None},
     "engine": {"scheduling_policy": "weighted_fair", "queue_timeout": "1 s", "on_timeout": "reject"},
     "slo": {"percentile": {"ttft": 99, "tpot": 95}, "e2e": "30 s",
             "classes": {"chat": {"ttft": "300 ms", "percentile": 90}}}},
    {"speculation": {"draft": "eagle", "k": 3, "policy": "goodput", "scope": "per_batch", "tree_branching": 2,
                     "acceptance": {"process": "predicted", "workload": "code", "distilled": False},
                     "eligibility": {"min_sequence_tokens": 0, "min_concurrent_requests": 1}}},
    {"speculation": {"draft": "medusa", "heads": 3, "k": 3, "acceptance": {"process": "positional",
                                                                         "alpha": 0.8, "decay": 0.9}}},
    {"speculation": {"draft": "ngram", "ngram_cpu_per_sequence": "50 us", "k": 2, "scorer": "batch_expansion",
                     "acceptance": {"process": "beta", "mean": 0.6, "concentration": 8}}},
    {"speculation": {"draft": "mtp", "allow_missing_mtp": True, "k": 2,
                     "acceptance": {"process": "beta", "a": 3, "b": 2}}},
    {"speculation": {"draft": "Llama-3.2-1B", "placement": "separate", "draft_devices": 1,
                     "allow_different_vocabulary": False, "allow_larger_draft": False, "k": 4, "k_max": 6,
                     "policy": "adaptive", "window": 10, "raise_above": 0.8, "lower_below": 0.5,
                     "fallback": True, "prior_alpha": 0.7,
                     "acceptance": {"process": "replay", "path": "{tmp}/accepted.csv", "column": "accepted",
                                    "measured_k": 8}}},
    {"speculation": {"draft": "Llama-3.2-1B", "draft_tensor_parallel": 1, "k": 2,
                     "acceptance": {"process": "bernoulli", "alpha": 0.7}}},
    {"speculation": {"draft": "Llama-3.2-1B", "k": 2, "acceptance": {"process": "predicted",
                                                                   "same_family": True}}},
    {"controller": {"rule": "pid", "knob": "max_batch_tokens", "interval": "5 s", "window": "10 s",
                    "bounds": [1024, 8192], "hysteresis": 0.5, "kp": 2, "ki": 0.2, "kd": 0}},
    {"controller": {"rule": "aimd", "knob": "max_num_seqs", "decrease": 0.5, "increase": 16}},
    {"controller": {"rule": "practice", "timeout_factor": 0.8}},
    {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_outstanding": 64, "interval": "10 s",
                     "sustain": 3, "cold_start": "60 s"}},
    {"rollout": {"groups": {"canary": {"role": "canary", "fraction": 0.25, "replicas": 1,
                                       "engine": {"max_batch_tokens": 4096}, "hardware": "H200"}},
                 "replications": 5}},
    {"model": {"name": "mine", "num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8,
               "intermediate_size": 14336, "vocab_size": 128256, "max_context": 16384}},
    {"model": {"base": "Mistral-7B-v0.1", "weight_dtype": "fp8", "kv_dtype": "fp8",
               "expert_dtype": "fp8", "embedding_dtype": "bf16", "sliding_window": 4096,
               "sliding_window_layers": 16, "max_context": 16384, "name": "mistral-fp8"}},
    {"model": {"config_json": "{tmp}/config.json", "name": "from-config"}},
    {"deployment": {"disaggregation": {"prefill": {"hardware": "H100-SXM", "replicas": 2, "tensor_parallel": 1,
                                                   "pipeline_parallel": 1},
                                       "decode": {"hardware": "H200", "replicas": 1, "tensor_parallel": 1,
                                                  "pipeline_parallel": 1},
                                       "link": "infiniband_ndr", "streaming": True, "reservation": "after_transfer",
                                       "aggregated_below_tokens": 256}}},
    {"model": "Qwen3-30B-A3B", "hardware": "H200",
     "deployment": {"disaggregation": {
         pool: {"replicas": 1, "tensor_parallel": 1,
                "expert_parallel": {"degree": degree, "routing": {"distribution": "zipf", "exponent": 0.8}},
                "engine": {"max_num_seqs": 64, "max_batch_tokens": 2048, "chunked_prefill": True}}
         for pool, degree in (("prefill", 2), ("decode", 8))} | {"link": "infiniband_ndr"}}},
    {"model": "Qwen3-30B-A3B", "hardware": "H200",
     "deployment": {"disaggregation": {
         pool: {"replicas": 1, "tensor_parallel": 2,
                "expert_parallel": {"degree": 16, "redundant_experts": 16, "balance": True, "devices_per_node": 8,
                                    "scale_out_bandwidth": "50 GB/s",
                                    "routing": {"distribution": "histogram", "path": "{tmp}/experts.csv"}}}
         for pool in ("prefill", "decode")} | {"link": "infiniband_ndr"}}},
    {"deployment": {"tensor_parallel": "auto", "pipeline_parallel": "auto"},
     "engine": {"kv_spill": False, "admission": "guaranteed_no_evict", "chunked_prefill": False,
                "runtime_reserve": "1 GiB"},
     "simulation": {"warmup": "30 s", "horizon": "1 h"}, "seed": 7},
    {"model": "Qwen3-30B-A3B", "hardware": "H200",
     "deployment": {"tensor_parallel": 1, "pipeline_parallel": 1,
                    "expert_parallel": {"degree": 8, "routing": {"distribution": "zipf", "exponent": 0.8}}}},
    {"model": "Qwen3-30B-A3B", "hardware": "H200",
     "deployment": {"tensor_parallel": 2, "pipeline_parallel": 1,
                    "expert_parallel": {"degree": 16, "redundant_experts": 16, "balance": True, "devices_per_node": 8,
                                        "scale_out_bandwidth": "50 GB/s",
                                        "routing": {"distribution": "histogram", "path": "{tmp}/experts.csv"}}}},
)

# What a small file "{tmp}/NAME" holds, written by the generator before COVERAGE loads.
COVERAGE_FILES = {
    "accepted.csv": "accepted\n" + "\n".join(str(i % 9) for i in range(40)) + "\n",
    "experts.csv": "tokens\n" + "\n".join(str(1000 // (i + 1)) for i in range(128)) + "\n",
    "dataset.json": '[{"conversations": [{"from": "human", "value": "' + "word " * 60 + '"}, '
                    '{"from": "gpt", "value": "' + "word " * 30 + '"}]}]',
    "config.json": '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, '
                   '"intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, '
                   '"num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, '
                   '"torch_dtype": "bfloat16", "tie_word_embeddings": false}',
}

# Lengths (prompt, output, a class's, a session's turns) share one reader: one set of words for each.
_LENGTH = {
    "": "a fixed number of tokens, or a distribution: `{distribution: lognormal, mean: 1024, sigma: 1.0, max: 8192}`",
    ".distribution": "the distribution's law; each knows its exact mean after rounding and clipping, and one whose "
                     "clipping moves the stated mean more than 10% is refused",
    ".value": "the fixed length",
    ".low": "the smallest length of a uniform distribution",
    ".high": "the largest length of a uniform distribution",
    ".mean": "the mean before clipping to [min, max] (lognormal, exponential)",
    ".sigma": "the standard deviation of the length's logarithm (lognormal)",
    ".min": "lengths are clipped to at least this",
    ".max": "lengths are clipped to at most this",
    ".path": "a CSV file whose column holds the lengths to draw from (empirical)",
    ".column": "the CSV column to draw from (empirical)",
}

KEY_HELP: dict[str, str] = {
    "name": "the scenario's name: the output folder `runs/<name>` and the report title",
    "seed": "every random stream (arrivals, lengths, acceptance draws) derives from it; the same seed gives "
            "identical records",
    "model": "the target model: a catalog name (`llmsim models`), a path to a Hugging Face config.json or a model "
             "YAML, or a mapping: `{base: NAME, ...overrides}`, `{config_json: PATH}` or every field inline",
    "model.base": "a catalog model the other keys of this mapping override",
    "model.config_json": "a Hugging Face config.json to read the architecture from",
    "model.name": "the model's name (required for a model given inline)",
    "model.num_layers": "decoder layers",
    "model.hidden_size": "the residual stream's width",
    "model.num_heads": "attention (query) heads",
    "model.num_kv_heads": "key/value heads (grouped-query attention); default: num_heads",
    "model.head_dim": "the width of one head; 0: hidden_size / num_heads",
    "model.intermediate_size": "the MLP's inner width (of a dense layer)",
    "model.vocab_size": "vocabulary size (embedding and LM head)",
    "model.max_context": "the longest sequence (prompt + output) the model accepts",
    "model.tie_word_embeddings": "the LM head shares the embedding's weights",
    "model.qkv_bias": "the QKV projection has a bias",
    "model.sliding_window": "the sliding-window width of the local attention layers, in tokens",
    "model.sliding_window_layers": "how many layers use the sliding window; unset: all (as in Mistral)",
    "model.weight_dtype": "the weights' type; sets every weight unless expert_dtype or embedding_dtype say otherwise",
    "model.kv_dtype": "the KV cache's element type",
    "model.activation_dtype": "the activations' type",
    "model.expert_dtype": "the routed experts' weights' type, when it differs from weight_dtype (gpt-oss's fp4)",
    "model.embedding_dtype": "the embedding and LM head's type, when it differs from weight_dtype",
    "model.num_experts": "routed experts per MoE layer (1: a dense model)",
    "model.experts_per_token": "routed experts each token uses",
    "model.moe_intermediate_size": "one routed expert's inner width (0: intermediate_size)",
    "model.shared_expert_intermediate_size": "the shared experts' total inner width (0: none)",
    "model.dense_layers": "how many layers have a dense MLP instead of experts (DeepSeek's first_k_dense_replace)",
    "model.kv_lora_rank": "multi-head latent attention: the latent KV width (0: no MLA)",
    "model.q_lora_rank": "multi-head latent attention: the query's low-rank width (0: none)",
    "model.qk_rope_head_dim": "multi-head latent attention: the rotary part of each head",
    "model.v_head_dim": "multi-head latent attention: the value head width (0: head_dim)",
    "model.mtp_modules": "multi-token-prediction modules shipped with the weights (DeepSeek-V3: 1), usable as "
                         "`speculation.draft: mtp`",
    "model.params_published": "the published parameter count, to compare with the one derived from the fields",
    "model.source": "where the figures come from",
    "hardware": "a hardware profile's name (`llmsim hardware`) or a path to a profile YAML (relative to the "
                "scenario); names are searched in `$LLMSIM_PROFILE_PATH` before the shipped profiles",
    "deployment": "replicas and their parallelism",
    "deployment.replicas": "model replicas, each on its own devices (with expert_parallel: whole expert-parallel "
                           "groups)",
    "deployment.tensor_parallel": "devices one replica's layers are split over; `auto`: the fewest that hold the "
                                  "weights and one max_model_len request's KV cache; must divide the heads",
    "deployment.pipeline_parallel": "pipeline stages per replica, each keeping one micro-batch in flight; `auto`: "
                                    "placement decides (1 with speculation)",
    "deployment.router": "how requests are spread over replicas: in turn, to the replica with the fewest "
                         "outstanding requests, from one queue that replicas pull from, or to the replica holding the "
                         "longest cached prefix (needs engine.prefix_caching)",
    "deployment.load_bound": "`prefix_aware` only: a replica is chosen for its cache only while its outstanding "
                             "requests stay under this times the mean",
    "deployment.disaggregation": "prefill and decode on pools of their own, the prompt's KV cache sent between "
                                 "them (docs/guides/disaggregation.md); the deployment's own replicas and "
                                 "parallelism are then the aggregated layout plans compare it with",
    "deployment.disaggregation.prefill": "the pool that computes prompts",
    "deployment.disaggregation.decode": "the pool that decodes (and runs whole the requests below "
                                        "aggregated_below_tokens); it keeps no prefix cache",
    "deployment.disaggregation.prefill.hardware": "the pool's chip, as `hardware`",
    "deployment.disaggregation.prefill.replicas": "the pool's replicas, each on its own devices",
    "deployment.disaggregation.prefill.tensor_parallel": "devices a replica's layers are split over; must divide the "
                                                        "heads, and the replica must hold the weights and one "
                                                        "max_model_len request's KV",
    "deployment.disaggregation.prefill.pipeline_parallel": "pipeline stages per replica",
    "deployment.disaggregation.decode.hardware": "the pool's chip, as `hardware`",
    "deployment.disaggregation.decode.replicas": "the pool's replicas, each on its own devices",
    "deployment.disaggregation.decode.tensor_parallel": "devices a replica's layers are split over; must divide the "
                                                        "heads, and the replica must hold the weights and one "
                                                        "max_model_len request's KV",
    "deployment.disaggregation.decode.pipeline_parallel": "pipeline stages per replica",
    "deployment.disaggregation.link": "the link the KV crosses, one port per device of the narrower replica "
                                      "(with expert parallelism, of the narrower data-parallel rank; "
                                      "`llmsim.catalog.links`: bandwidth, efficiency and latency with their sources)",
    "deployment.disaggregation.streaming": "send the KV layer by layer while the prompt computes, so only the last "
                                           "layer's and what the link could not carry are left after it",
    "deployment.disaggregation.reservation": "when the decode replica takes the request's KV blocks: "
                                             "`before_transfer` (vLLM NixlConnector, SGLang, Dynamo: the prefill "
                                             "replica keeps its copy until then) or `after_transfer` (Mooncake: the "
                                             "KV waits in the decode node's host memory)",
    "deployment.disaggregation.aggregated_below_tokens": "prompts shorter than this (with prefix caching, their "
                                                         "part no prefill replica holds) run whole on a decode "
                                                         "replica; 0: none",
    "deployment.expert_parallel": "wide expert parallelism in the DeepSeek layout: a replica is one group of `degree` "
                                  "GPUs holding the routed experts, attention and the dense layers tensor parallel "
                                  "over tensor_parallel GPUs on degree / tensor_parallel data-parallel ranks, each "
                                  "with its own requests and KV cache (docs/guides/expert-parallelism.md)",
    "deployment.expert_parallel.degree": "GPUs the routed experts are spread over; a multiple of tensor_parallel; "
                                         "num_experts + redundant_experts must split evenly over them",
    "deployment.expert_parallel.redundant_experts": "extra expert slots (EPLB) holding copies of the hottest experts, "
                                                    "each copy taking an equal part of its expert's tokens",
    "deployment.expert_parallel.balance": "place the experts (and their copies) so that the GPUs' shares of the "
                                          "routed tokens are as even as a greedy packing makes them (EPLB); "
                                          "false: popularity independent of placement",
    "deployment.expert_parallel.devices_per_node": "GPUs of one NVLink domain: an all-to-all beyond it crosses the "
                                                   "scale-out network",
    "deployment.expert_parallel.scale_out_bandwidth": "per-GPU bandwidth between nodes (one 400 Gb/s NDR port: "
                                                      "50 GB/s); required when degree exceeds devices_per_node",
    "deployment.expert_parallel.routing": "how popular each expert is: the step waits for the GPU the "
                                          "multinomial draw of the step's assignments loads most",
    "deployment.expert_parallel.routing.distribution": "`uniform`; `zipf`: the i-th most popular expert drawn with "
                                                       "weight 1 / i^exponent; `histogram`: measured tokens per expert",
    "deployment.expert_parallel.routing.exponent": "the skew (0: uniform)",
    "deployment.expert_parallel.routing.path": "a CSV with a `tokens` column, one row per expert "
                                               "in expert order",
    "engine": "the serving engine's scheduler settings (vLLM names where they exist)",
    "engine.batching": "`continuous`: iteration-level batching (vLLM, TensorRT-LLM); `static`: request-level "
                       "batches that run to their longest output (FasterTransformer, early TGI)",
    "engine.max_num_seqs": "sequences running at once per replica (vLLM max_num_seqs)",
    "engine.max_batch_tokens": "token budget per iteration, prefill chunks and decode tokens together (vLLM "
                               "max_num_batched_tokens); at least max_num_seqs",
    "engine.chunked_prefill": "prompts are prefilled in chunks beside decoding sequences; false: prefill-first, "
                              "prefill-only iterations (vLLM V0)",
    "engine.async_scheduling": "the CPU part of a step (scheduling, input preparation) overlaps the previous "
                               "GPU step, as vLLM's --async-scheduling does; a step after an idle engine pays both",
    "engine.block_size": "tokens per KV-cache block (vLLM's default is 16; it is used whenever vLLM flags or "
                         "`defaults: vllm` are given)",
    "engine.memory_utilization": "the fraction of device memory for weights, activations and KV cache (vLLM "
                                 "gpu_memory_utilization)",
    "engine.runtime_reserve": "memory per device kept for the CUDA context and communication buffers",
    "engine.max_model_len": "the longest request (prompt + output) accepted; longer ones are rejected (reason "
                            "too_long); the KV cache must hold one",
    "engine.queue_timeout": "a request waiting longer than this is dispatched or rejected (on_timeout)",
    "engine.on_timeout": "what happens at queue_timeout: force the request into the next iteration past the token "
                         "budget, or reject it",
    "engine.kv_spill": "keep the KV cache in the profile's first outer memory tier (MemoryX, host DDR) instead of "
                       "the primary one",
    "engine.scheduling_policy": "who joins the batch next when the workload has traffic classes (see the traffic "
                                "classes guide); anything but fcfs needs workload.classes",
    "engine.admission": "how requests are admitted against the KV cache: vLLM's (a prompt joins when the rest "
                        "of it fits beside what running prompts still need, above a 1% watermark; preempt the "
                        "latest and recompute when out), TensorRT-LLM's MAX_UTILIZATION (blocks for the whole "
                        "prompt) or GUARANTEED_NO_EVICT (prompt + output reserved up front, never evicts)",
    "engine.prefix_caching": "reuse the KV blocks of shared prompt prefixes (vLLM enable_prefix_caching)",
    "engine.preemption_mode": "what a preempted sequence does: recompute its KV later, or swap it to host memory "
                              "(needs a profile with host_memory)",
    "engine.cpu_offload": "idle cached KV blocks move to host memory: true (the defaults below) or a mapping; needs "
                          "prefix_caching and a profile with host_memory",
    "engine.cpu_offload.idle_timeout": "a cached block idle this long on the device moves to host memory",
    "engine.cpu_offload.overlap": "reloads overlap the admitting iteration's compute (else they add to it)",
    "engine.cpu_offload.capacity": "host memory for KV per device; default: the profile's host_memory capacity",
    "engine.kernels": "whose measured kernels price a step: the engine the operator database timed them in (vLLM's "
                      "are the profile's kernels; sglang and trtllm need the profile's kernels.engines terms)",
    "engine.vllm_args": "`vllm serve` flags (`--max-num-seqs 128 -tp 2 ...`), read into the keys they set; flags "
                        "llmsim does not model are listed with why and kept in summary.json; a setting given both "
                        "as a flag and as a key is refused",
    "engine.defaults": "whose defaults apply to unset engine keys: llmsim's, or vLLM's (block_size 16, prefix "
                       "caching on); `vllm` whenever vllm_args is given",
    "engine.<vLLM name>": "vLLM's engine-argument names (snake or kebab case) for what llmsim models, e.g. "
                          "`max_num_batched_tokens`, `gpu_memory_utilization`, `enable_prefix_caching`; see the vLLM "
                          "settings guide for the full table",
    "workload": "the requests: when they arrive and how long they are",
    "workload.arrival": "the arrival process",
    "workload.arrival.process": "poisson, gamma (bursty, with cv), deterministic, a replayed trace, or a rate that "
                                "changes with time: diurnal, steps, ramp, mmpp",
    "workload.arrival.rate": "the mean arrival rate; for a trace, the trace's times are stretched so that its mean "
                             "rate is this (bursts keep their shape)",
    "workload.arrival.cv": "the coefficient of variation of the gaps between arrivals (1: Poisson; above 1: bursty)",
    "workload.arrival.amplitude": "the diurnal swing: rate x (1 + amplitude cos(2 pi (t - peak) / period))",
    "workload.arrival.period": "the length of one diurnal cycle",
    "workload.arrival.peak": "when in the cycle the diurnal rate peaks; default: half the period",
    "workload.arrival.rates": "`steps` and `ramp`: a list of `{at, rate}` points; steps hold each rate until the next "
                              "point, ramps are linear in between",
    "workload.arrival.rates[].at": "when this rate starts (times must increase)",
    "workload.arrival.rates[].rate": "the rate from then on (the last one must be positive)",
    "workload.arrival.states": "`mmpp`: a list of `{rate, mean_duration}` states, visited in turn, each for an "
                               "exponential time (two or more)",
    "workload.arrival.states[].rate": "the state's arrival rate",
    "workload.arrival.states[].mean_duration": "the state's mean holding time",
    "workload.arrival.path": "the trace file to replay",
    "workload.arrival.format": "the trace's format; `auto` detects it from the columns (or a JSON file's first "
                               "character)",
    "workload.arrival.failed": "a production trace's failed requests (logged with 0 output tokens, as BurstGPT does): "
                               "`drop` them, or `replay` each as its prompt (at least one token) and one output "
                               "token; the printout counts them either way",
    "workload.arrival.hash_block_tokens": "prompt tokens per hash id of a Mooncake trace's hash_ids (the prefix "
                                          "cache's block identities); engine.block_size must divide it",
    "workload.arrival.window": "replay only the requests that arrived in [start, end), times counted from start",
    "workload.arrival.window.start": "the window's start, from the trace's first arrival",
    "workload.arrival.window.end": "the window's end; default: the end of the trace",
    "workload.arrival.filter": "replay only the requests whose column has this value (or one of these values)",
    "workload.arrival.filter.model": "BurstGPT's Model column (e.g. ChatGPT, GPT-4)",
    "workload.arrival.filter.log_type": "BurstGPT's Log Type column (API log, Conversation log)",
    "workload.arrival.sample": "replay this fraction of the requests, drawn from the scenario seed",
    "workload.arrival.speed": "divide every gap between arrivals by this (2: twice as fast); give speed or rate, "
                              "not both",
    "workload.num_requests": "how many requests arrive (give this or duration)",
    "workload.duration": "how long requests arrive for (give this or num_requests)",
    "workload.dataset": "lengths from a ShareGPT-style dataset, in rounds as `vllm bench serve` does, for arrivals "
                        "drawn from the process (no times of its own)",
    "workload.dataset.path": "the dataset file (a JSON list or JSON lines)",
    "workload.dataset.format": "the dataset's format; `auto` detects it",
    "workload.dataset.tokenizer": "a tokenizer.json to count tokens with (the optional tokenizers package); or "
                                  "give chars_per_token",
    "workload.dataset.chars_per_token": "count tokens as characters / this (an approximation: about 4 for English "
                                        "with Llama-style tokenizers)",
    "workload.classes": "traffic classes sharing the deployment, each with its share (or own arrival), lengths, "
                        "priority, queue timeout and SLO",
    "workload.classes.<name>": "one traffic class",
    "workload.classes.<name>.share": "the class's share of the workload's arrivals (the shares sum to 1); or give "
                                     "the class an arrival of its own",
    "workload.classes.<name>.arrival": "the class's own arrival process (the same keys as workload.arrival)",
    "workload.classes.<name>.arrival.process": "as workload.arrival.process",
    "workload.classes.<name>.arrival.rate": "as workload.arrival.rate",
    "workload.classes.<name>.priority": "0 is most urgent; default by name: interactive 0, standard 1, batch 2, "
                                        "any other name 0 (an assumption from serving practice)",
    "workload.classes.<name>.weight": "the class's share of tokens under weighted_fair",
    "workload.classes.<name>.reserved_seqs": "sequence slots no other class may take, kept free even when the "
                                             "class is idle",
    "workload.classes.<name>.queue_timeout": "the class's queue timeout; default by name: interactive 50 ms, "
                                             "standard 200 ms, batch 1000 ms, else the engine's",
    "workload.classes.<name>.on_timeout": "at the timeout: dispatch (past the token budget), dedicated (past the "
                                          "budget and max_num_seqs, into at most dedicated_seqs extra slots) or "
                                          "reject",
    "workload.classes.<name>.dedicated_seqs": "extra slots the class's timed-out requests may use with "
                                              "`on_timeout: dedicated`",
    "workload.sessions": "multi-turn conversations: each turn's prompt carries the conversation so far",
    "workload.sessions.turns": "turns per conversation (a length: a number or a distribution)",
    "workload.sessions.think_time": "the user's pause between a reply and the next turn",
    "workload.sessions.system_prompt": "a system prompt shared by many conversations",
    "workload.sessions.system_prompt.tokens": "its length",
    "workload.sessions.system_prompt.share": "the share of conversations that start with one",
    "workload.sessions.system_prompt.variants": "how many different system prompts there are",
    "workload.sessions.start": "what a run starts from: `empty` (no conversation yet) or `stationary` (conversations "
        "already in progress, as in the steady state; a constant session rate); searches start stationary",
    "slo": "per-request latency limits; a request meets the SLO when every limit set holds",
    "slo.ttft": "time to first token limit",
    "slo.tpot": "time per output token limit (mean gap after the first token)",
    "slo.e2e": "end-to-end latency limit",
    "slo.percentile": "the targets of plan and recommend: P-th percentile of each metric within its limit; one "
                      "number for all, or `{ttft: 99, tpot: 95}`",
    "slo.percentile.ttft": "the TTFT target's percentile",
    "slo.percentile.tpot": "the TPOT target's percentile",
    "slo.percentile.e2e": "the end-to-end target's percentile",
    "slo.classes": "each traffic class's own limits and percentile, over the top-level ones",
    "slo.classes.<name>": "one class's SLO (the name of a workload class)",
    "slo.classes.<name>.ttft": "the class's TTFT limit",
    "slo.classes.<name>.tpot": "the class's TPOT limit",
    "slo.classes.<name>.e2e": "the class's end-to-end limit",
    "slo.classes.<name>.percentile": "the class's percentile (one number, or per metric)",
    "simulation": "the measurement window and the run's end",
    "simulation.warmup": "excluded from the steady-state figures; default: 10% of the arrival window",
    "simulation.horizon": "the simulation stops here; default: twice the arrival window, at least 60 s past it, "
                          "and twice the deployment's time to serve every request back to back where that is "
                          "longer (offline runs)",
    "speculation": "speculative decoding: a draft proposes k tokens, the target verifies them in one pass",
    "speculation.draft": "what proposes the tokens: a draft model (catalog name, config.json path or inline "
                         "mapping, as model), `eagle` (an EAGLE head), `mtp` (the target's multi-token-prediction "
                         "module), `medusa` (Medusa heads) or `ngram` (prompt lookup)",
    "speculation.placement": "a draft model on the target's devices, or on devices of its own",
    "speculation.draft_devices": "`placement: separate`: the draft's own devices per replica",
    "speculation.draft_tensor_parallel": "the draft's tensor parallelism; default: the target's, when the draft's "
                                         "heads allow it",
    "speculation.heads": "Medusa heads (each drafts one token: k at most heads)",
    "speculation.tree_branching": "verify a b-ary tree of candidates k levels deep (1: a chain)",
    "speculation.ngram_cpu_per_sequence": "CPU time per speculating sequence for n-gram lookup, serial with the "
                                          "GPU step",
    "speculation.ngram_cpu_per_context_token": "CPU time of the n-gram lookup per context token scanned "
                                               "(single-threaded, measured in vLLM: 1.06 ns), serial with the GPU step",
    "speculation.scorer": "how the target scores a chain of draft tokens: `mqa`, one chunk of k + 1 positions per "
                          "sequence, or `batch_expansion`, vLLM V0's k + 1 one-token decode sequences per sequence, "
                          "each reading its whole KV cache (V0's scorer whenever the target ran with CUDA graphs)",
    "speculation.allow_missing_mtp": "allow `draft: mtp` on a target whose checkpoint ships no MTP module (one you "
                                     "trained)",
    "speculation.allow_different_vocabulary": "allow a draft with another vocabulary",
    "speculation.allow_larger_draft": "allow a draft larger than the target",
    "speculation.policy": "how k is chosen: fixed, the adaptive 80/50 rule, or the k that maximises goodput by the "
                          "cost model",
    "speculation.k": "draft tokens per step (static), or the starting k (adaptive); 0: plain decoding",
    "speculation.k_max": "the largest k the adaptive and goodput policies use; default: max(8, k), Medusa: heads",
    "speculation.scope": "whether k is chosen per request or one k for the whole batch; default: per_batch for "
                         "goodput, else per_request",
    "speculation.window": "adaptive: steps whose acceptance the rule averages",
    "speculation.raise_above": "adaptive: raise k when the accepted share is above this",
    "speculation.lower_below": "adaptive: lower k when the accepted share is below this",
    "speculation.fallback": "adaptive: fall back to plain decoding when k reaches 0",
    "speculation.prior_alpha": "goodput: the acceptance assumed before any is observed",
    "speculation.acceptance": "how many draft tokens the target accepts",
    "speculation.acceptance.process": "bernoulli (each token with probability alpha), positional (alpha decaying "
                                      "with position), beta (alpha per request from a Beta law), replay (measured "
                                      "accepted lengths) or predicted (alpha from the draft/target pair)",
    "speculation.acceptance.alpha": "the per-token acceptance probability",
    "speculation.acceptance.decay": "positional: alpha is multiplied by this per position",
    "speculation.acceptance.mean": "beta: the mean alpha",
    "speculation.acceptance.concentration": "beta: a + b (higher: less spread across requests)",
    "speculation.acceptance.a": "beta: the Beta law's a (instead of mean and concentration)",
    "speculation.acceptance.b": "beta: the Beta law's b",
    "speculation.acceptance.path": "replay: a CSV of measured accepted lengths",
    "speculation.acceptance.column": "replay: its column",
    "speculation.acceptance.measured_k": "replay: the k the lengths were measured at (at least k_max)",
    "speculation.acceptance.workload": "predicted: the kind of text, which shifts the predicted alpha",
    "speculation.acceptance.distilled": "predicted: the draft was distilled from the target (an assumed offset)",
    "speculation.acceptance.same_family": "predicted: the draft is of the target's family; default: from the names "
                                          "and vocabularies",
    "speculation.eligibility": "which sequences speculate",
    "speculation.eligibility.min_sequence_tokens": "a sequence speculates once it holds this many tokens",
    "speculation.eligibility.min_concurrent_requests": "speculation runs only while at least this many requests "
                                                       "are running (a lone stream does not, by default)",
    "controller": "an adaptive controller that moves one engine knob while the run goes on",
    "controller.rule": "practice (halve on a violation, step back when all is well), aimd (multiplicative cut, "
                       "additive increase) or pid",
    "controller.knob": "the setting it moves (speculation_k: a static k policy's draft length)",
    "controller.interval": "how often it acts",
    "controller.window": "the rolling window whose percentiles it reads; default: 3 x interval",
    "controller.bounds": "`[low, high]` the knob stays within; must hold the engine's setting; default: an eighth "
                         "of the setting up to it",
    "controller.hysteresis": "relax only below (1 - hysteresis) x every limit",
    "controller.decrease": "practice and aimd: the factor a violation multiplies the knob by",
    "controller.increase": "aimd: the step added when all is well; default: a tenth of the bounds' span",
    "controller.timeout_factor": "practice: class queue timeouts are multiplied by this on a violation",
    "controller.kp": "pid: proportional gain",
    "controller.ki": "pid: integral gain",
    "controller.kd": "pid: derivative gain",
    "autoscaling": "replicas started and drained with the load, as Kubernetes' horizontal autoscaler; "
                   "deployment.replicas serve at the start",
    "autoscaling.min_replicas": "never fewer replicas",
    "autoscaling.max_replicas": "never more replicas",
    "autoscaling.target_outstanding": "requests (waiting + running) per serving replica it aims at",
    "autoscaling.interval": "how often it checks",
    "autoscaling.sustain": "checks in a row wanting a change before it acts",
    "autoscaling.cold_start": "a started replica serves after this",
    "rollout": "canary and shadow groups beside the deployment (the control)",
    "rollout.groups": "the groups, by name",
    "rollout.groups.<name>": "one group",
    "rollout.groups.<name>.role": "canary: serves its fraction of the requests in place of the control; shadow: "
                                  "gets a copy of its fraction, whose answers go nowhere",
    "rollout.groups.<name>.fraction": "the share of requests it serves (canary) or copies (shadow)",
    "rollout.groups.<name>.replicas": "its replicas",
    "rollout.groups.<name>.engine": "engine settings laid over the scenario's engine",
    "rollout.groups.<name>.hardware": "another hardware profile for the group",
    "rollout.replications": "independent runs of the whole rollout (seeds seed, seed + 1, ...): 1 compares by "
                            "batch means within the run; 2 or more (5+ advised) by Student t across the runs",
    "plan": "read by `llmsim plan` only",
    "plan.hardware": "the chips `llmsim plan` compares when `--hardware` is not given; default: the scenario's own",
}
KEY_HELP.update({f"<length>{suffix}": text for suffix, text in _LENGTH.items() if suffix})
# A disaggregated pool's own expert-parallel group and engine settings: the top-level keys' meaning, for the pool.
for _pool in ("prefill", "decode"):
    KEY_HELP.update({
        f"deployment.disaggregation.{_pool}.{key.removeprefix('deployment.')}": f"as `{key}`, for this pool"
        for key in KEY_HELP if key.startswith("deployment.expert_parallel.")})
    KEY_HELP.update({
        f"deployment.disaggregation.{_pool}.expert_parallel": "the pool's own expert-parallel group, with the "
            "settings of `deployment.expert_parallel` (a replica of the pool is then one group); none where the "
            "pool sets none, whatever the aggregated layout's",
        f"deployment.disaggregation.{_pool}.engine": "the pool's own engine settings (real deployments tune prefill "
            "and decode apart); the `engine` block's where the pool sets none",
        f"deployment.disaggregation.{_pool}.engine.max_num_seqs": "as `engine.max_num_seqs`, for this pool",
        f"deployment.disaggregation.{_pool}.engine.max_batch_tokens": "as `engine.max_batch_tokens`, for this pool; "
            "at least its max_num_seqs",
        f"deployment.disaggregation.{_pool}.engine.chunked_prefill": "as `engine.chunked_prefill`, for this pool"
            + ("" if _pool == "prefill" else "; the decode pool must chunk (it continues each transferred "
               "prompt's last token as a chunk)"),
    })
KEY_HELP.update({
    "workload.prompt_tokens": "prompt lengths: " + _LENGTH[""] + " (the keys are under `<length>`)",
    "workload.output_tokens": "output lengths, as prompt_tokens",
    "workload.sessions.turns": "turns per conversation, a length as prompt_tokens",
    "workload.classes.<name>.prompt_tokens": "the class's prompt lengths, as workload.prompt_tokens",
    "workload.classes.<name>.output_tokens": "the class's output lengths, as workload.output_tokens",
})

# What the reader's calls cannot say: a type with two forms, a default computed from other settings.
_DEPENDS = "depends"
KEY_OVERRIDES: dict[str, dict[str, str]] = {
    "name": {"type": "string", "default": "the file's name"},
    "model": {"type": "name, path or mapping", "default": "required"},
    "model.max_context": {"default": ""},
    "model.name": {"default": "required inline"},
    "model.num_kv_heads": {"default": "num_heads"},
    "deployment.tensor_parallel": {"type": "integer or `auto`", "allowed": ">= 1, or `auto`"},
    "deployment.pipeline_parallel": {"type": "integer or `auto`", "allowed": ">= 1, or `auto`"},
    "engine.cpu_offload": {"type": "boolean or mapping"},
    "deployment.disaggregation.prefill.hardware": {"default": "`hardware`"},
    "deployment.disaggregation.decode.hardware": {"default": "`hardware`"},
    "deployment.expert_parallel.scale_out_bandwidth": {"default": "none (one node)"},
    "engine.max_model_len": {"default": "the model's context"},
    "workload.prompt_tokens": {"type": "integer or mapping", "default": "required"},
    "workload.output_tokens": {"type": "integer or mapping", "default": "required"},
    "workload.classes.<name>.prompt_tokens": {"type": "integer or mapping", "default": "the workload's"},
    "workload.classes.<name>.output_tokens": {"type": "integer or mapping", "default": "the workload's"},
    "workload.sessions.turns": {"type": "integer or mapping"},
    "workload.arrival.rates": {"type": "list"},
    "workload.arrival.states": {"type": "list"},
    "workload.arrival.filter.model": {"type": "string or list", "default": ""},
    "workload.arrival.filter.log_type": {"type": "string or list", "default": ""},
    "workload.classes.<name>.priority": {"default": "by name"},
    "workload.classes.<name>.queue_timeout": {"default": "by name"},
    "workload.classes.<name>.on_timeout": {"default": "`dispatch`"},
    "slo.percentile": {"type": "number or mapping", "default": "`95`", "allowed": "> 0 and <= 100"},
    "slo.classes": {"type": "mapping of names"},
    "slo.classes.<name>.ttft": {"default": "slo.ttft"},
    "slo.classes.<name>.tpot": {"default": "slo.tpot"},
    "slo.classes.<name>.e2e": {"default": "slo.e2e"},
    "slo.classes.<name>.percentile": {"type": "number or mapping", "default": "slo.percentile"},
    "simulation.warmup": {"default": "10% of arrivals"},
    "workload.arrival.peak": {"default": "period / 2"},
    "simulation.horizon": {"default": _DEPENDS},
    "speculation.draft": {"type": "name, path, mapping or kind", "default": "required"},
    "speculation.k_max": {"default": _DEPENDS},
    "speculation.scope": {"default": _DEPENDS},
    "speculation.acceptance.same_family": {"default": _DEPENDS},
    "speculation.draft_tensor_parallel": {"default": "the target's"},
    "controller.window": {"default": "3 x interval"},
    "controller.increase": {"default": _DEPENDS},
    "controller.bounds": {"type": "list of two", "default": _DEPENDS},
    "rollout.groups.<name>.engine": {"type": "mapping"},
    "<length>.column": {"default": "the key's name"},
    "<length>.max": {"default": "max_model_len"},
}
for _pool in ("prefill", "decode"):
    KEY_OVERRIDES.update({f"deployment.disaggregation.{_pool}.engine.{key}": {"default": f"`engine.{key}`"}
                          for key in ("max_num_seqs", "max_batch_tokens", "chunked_prefill")})
    KEY_OVERRIDES[f"deployment.disaggregation.{_pool}.expert_parallel.scale_out_bandwidth"] = {
        "default": "none (one node)"}

# Keys read outside the Node accessors (the vLLM vocabulary rewrites the engine section before it is read;
# `plan.hardware` is a list, read whole), with what the reader of each allows.
EXTRA_KEYS: dict[str, dict[str, str]] = {
    "engine.vllm_args": {"type": "string", "default": "", "allowed": "`vllm serve` flags"},
    "engine.defaults": {"type": "one of", "default": _DEPENDS, "allowed": "`llmsim`, `vllm`"},
    "engine.<vLLM name>": {"type": "as the key it sets", "default": "", "allowed": "vLLM's engine arguments"},
    "plan": {"type": "mapping", "default": "", "allowed": ""},
    "plan.hardware": {"type": "list of profile names", "default": _DEPENDS, "allowed": ""},
}
