"""SGLang 0.5.23's metric, label and endpoint names that specpilot reads, in one place.

Owns the spelling of every SGLang-side name the controller depends on (read from the released
0.5.23 wheel: srt/observability/metrics_collector.py, srt/entrypoints/v1_loads.py,
srt/managers/load_snapshot.py, srt/entrypoints/http_server.py). Family names are given as
prometheus_client's parser reports them: a counter's family drops the `_total` suffix its samples
carry. Holds no logic and must not import anything outside the standard library.
"""

from __future__ import annotations

from typing import Final

# --- scheduler gauges (set every --decode-log-interval decode steps, multiprocess "mostrecent") ---
NUM_RUNNING_REQS: Final = "sglang:num_running_reqs"
NUM_QUEUE_REQS: Final = "sglang:num_queue_reqs"
GEN_THROUGHPUT: Final = "sglang:gen_throughput"  # tok/s over the last log interval
SPEC_ACCEPT_LENGTH: Final = "sglang:spec_accept_length"  # accepted drafts + bonus per verify step
SPEC_ACCEPT_RATE: Final = "sglang:spec_accept_rate"  # correct drafts / proposed drafts
SPEC_NUM_STEPS: Final = "sglang:spec_num_steps"  # tier active now (moves under adaptive)
SPEC_NUM_DRAFT_TOKENS: Final = "sglang:spec_num_draft_tokens"

# --- scheduler counters (families; samples carry `_total`) ---
REALTIME_TOKENS: Final = "sglang:realtime_tokens"  # label MODE: decode | prefill_compute | ...
CUDA_GRAPH_PASSES: Final = "sglang:cuda_graph_passes"  # label MODE: decode_cuda_graph | ...
FORWARD_EXECUTION_SECONDS: Final = "sglang:forward_execution_seconds"  # label CATEGORY

# --- tokenizer counters (per finished request; carry the custom `workload` label) ---
GENERATION_TOKENS: Final = "sglang:generation_tokens"  # + label is_streaming
SPEC_VERIFY_CALLS: Final = "sglang:spec_verify_calls"
NUM_REQUESTS: Final = "sglang:num_requests"  # + label is_streaming

# --- startup gauges (label PHASE) ---
STARTUP_TIME_SECONDS: Final = "sglang:startup_time_seconds"
STARTUP_CUDA_GRAPH_TIME_SECONDS: Final = "sglang:startup_cuda_graph_time_seconds"

# Suffix a counter's samples carry in the exposition (the parser strips it from the family).
COUNTER_SAMPLE_SUFFIX: Final = "_total"

# Label values of `mode` on REALTIME_TOKENS and CUDA_GRAPH_PASSES that count decode work.
MODE_DECODE_TOKENS: Final = "decode"
MODES_DECODE_PASSES: Final = ("decode_cuda_graph", "decode_none")

# --- label names ---
LABEL_MODEL_NAME: Final = "model_name"
# Scheduler label sets by version: 0.4.6 {model_name, engine_type}; 0.4.10 {model_name,
# engine_type, tp_rank, pp_rank[, dp_rank]}; 0.5.23 {model_name, engine_type, tp_rank, pp_rank,
# moe_ep_rank[, dp_rank][, priority]}. Tokenizer series: {model_name} on 0.4.x; 0.5.23 adds
# engine_type, priority and the allowed custom labels.
LABEL_ENGINE_TYPE: Final = "engine_type"
LABEL_TP_RANK: Final = "tp_rank"
LABEL_PP_RANK: Final = "pp_rank"
LABEL_MOE_EP_RANK: Final = "moe_ep_rank"
LABEL_DP_RANK: Final = "dp_rank"  # only under data parallelism
# With --enable-priority-scheduling, queue gauges carry the total under priority="" and a
# per-priority breakdown under priority="<int>"; tokenizer counters carry each request's priority.
LABEL_PRIORITY: Final = "priority"
LABEL_MODE: Final = "mode"
LABEL_CATEGORY: Final = "category"
LABEL_PHASE: Final = "phase"
LABEL_IS_STREAMING: Final = "is_streaming"
# The custom tokenizer label specpilot asks clients to set
# (--tokenizer-metrics-allowed-custom-labels workload); SGLang leaves it "" when a request has none.
LABEL_WORKLOAD: Final = "workload"

# --- HTTP endpoints ---
PATH_METRICS: Final = "/metrics"
PATH_LOADS: Final = "/v1/loads"
LOADS_QUERY: Final = {"include": "core,spec"}
PATH_SERVER_INFO: Final = "/server_info"
PATH_SERVER_INFO_DEPRECATED: Final = "/get_server_info"  # pre-0.5 servers, deprecated in 0.5

# --- server args ---
FLAG_MAX_RUNNING_REQUESTS: Final = "--max-running-requests"
# What SGLang sets --max-running-requests to when it is unset and speculation is on.
SPEC_DEFAULT_MAX_RUNNING_REQUESTS: Final = 48

# --- /v1/loads JSON keys: {"timestamp", "version", "accelerator", "num_accelerators",
#     "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", "gen_throughput",
#                "max_running_requests", "decode_moments", ..., "speculative": {...}}]} ---
LOADS_KEY_LOADS: Final = "loads"
LOADS_KEY_DP_RANK: Final = "dp_rank"
LOADS_KEY_NUM_RUNNING: Final = "num_running_reqs"
LOADS_KEY_NUM_WAITING: Final = "num_waiting_reqs"
LOADS_KEY_GEN_THROUGHPUT: Final = "gen_throughput"
LOADS_KEY_MAX_RUNNING: Final = "max_running_requests"
# Cumulative [n_steps, sum_bs, sum_step_us, sum_bs2, sum_bs_step_us, sum_generated]; null until
# the first decode step. Indices of the microsecond entries:
LOADS_KEY_DECODE_MOMENTS: Final = "decode_moments"
DECODE_MOMENTS_LEN: Final = 6
DECODE_MOMENTS_US_INDICES: Final = (2, 4)
LOADS_KEY_SPECULATIVE: Final = "speculative"  # {"accept_length" (lifetime), "accept_rate"}
