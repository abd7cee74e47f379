"""The ``--help`` descriptions of the ``pdserve bench`` subcommands whose benchmark module is
not light to import (:data:`pdserve.bench.bench_commands.COMMANDS` takes them from here; the
others' ``DESCRIPTION`` lives in their module). Text only: importing this module costs nothing.
"""

from __future__ import annotations

TRANSFER_DESCRIPTION = """\
KV transfer GB/s per backend (tcp, NIXL over TCP and shared memory, ucx) beside a raw-socket
stream and a memcpy of the same byte counts, in one run: each case moves KV blocks of SmolLM2's
layout between two fresh processes, as workers do (handshake once, then per request SendBlocks
-> bytes -> Release), with integrity digests off and on (--backends default: tcp nixl ucx).
Sizes default to 1 block (0.7 MiB) .. 91 blocks (64 MiB), 23 blocks (16.2 MiB) among them.
Prints p50 GB/s per size, a fit t = c + bytes/B per series (c: fixed cost per transfer, B:
bandwidth), and the targets, each MET, MISSED or "not measured" (a case it needs was not run):
fixed cost c <= 100 us on tcp and nixl-shm (digests off; other cases' c as info); tcp >= 0.9x
raw socket at every size from 1 MiB; nixl-shm >= 0.7x memcpy at 16 MiB (at the size closest to
16 MiB when --sizes-mib leaves it out; the report says which); digests on >= 0.8x digests off at
16 MiB, per case measured with both; with --tp-pairs, mapped hand-offs <= 1.3x unmapped.

--profile: where the fixed cost goes. Instead of the measurement, per backend (tcp, nixl) a
child process runs a prefill-side and a decode-side transceiver together, warms up, times
--profile-pulls one-block pulls, then runs as many under cProfile, and prints the CPU time per
pull and a table "function (file:line) | us per pull | share" of the top 15 by own time
(digests off unless --integrity on).
"""


MULTITURN_DESCRIPTION = """\
Multi-turn chat against pdserve stacks it starts itself: C conversations of T turns, each turn's
prompt extending the previous one (a shared system prompt of about S tokens, then the earlier
turns), K conversations at once, streamed greedy chat completions; every turn goes through the
prefill worker (router --local-prefill-max-tokens 0). --compare cache: router + 1 prefill + 1
decode with the prefix cache on, then off. --compare routing: router + --prefill-workers prefill
workers + 1 decode, KV-aware routing against least-loaded routing (both with the cache on).
--compare sessions: router + 1 prefill + --decode-workers decode workers with local prefill on,
each conversation's turns with an x-session-id header against without (session affinity);
also reports the mean cached prompt tokens per turn on turns 2+ and the session decisions.

Reported per stack: TTFT p50/p90 on turn 1 and on turns 2+, prompt tokens, tokens the prefill
workers computed and their prefix cache hit rate (from their /metrics); then the ratios against
the targets (cache on / off TTFT p50 on turns 2+ at most 0.3x; KV-aware hit rate at least 2x
least-loaded). The stacks take their settings from --config and PDSERVE_* variables.
"""


KV_RESTART_DESCRIPTION = """\
The first request after a restart, with the KV cache's disk tier (or, with --tier remote, its
remote tier on a Redis store): starts router + 1 prefill + 1 decode with kv_cache.disk_cache_dir
set to an empty directory (kv_cache.remote_cache to an empty store), times the TTFT of one long
prompt (cold), waits until the prefill worker wrote every block, stops the whole stack, starts
it again with empty local caches and times the same prompt (warm). A short warm-up request that
shares no prefix goes first each time and is not counted. With --tier remote the store is then
stopped and --outage-requests more requests go through the warm stack: none may fail.

Reported: both TTFTs, warm / cold against the target (at most 0.5x for disk, 0.2x for remote),
prompt tokens, tokens the restarted prefill worker loaded from the tier, and the directory's
files (the store's keys) and bytes. Exit 1 when the target is missed, nothing was loaded or a
request failed during the outage; 2 when --disk-dir is not empty or the store holds blocks. The
stacks take their other settings from --config and PDSERVE_* variables.
"""


FORMATTER_DESCRIPTION = """\
What KV layout conversion costs, on SmolLM2's layout: the staging kernel alone (gather + convert
into the staging buffer, beside a plain copy of the same bytes) for each mixed pair of block
sizes and dtypes, then whole pulls between two processes per backend, matched layouts (the
zero-copy path) beside each mixed pair. Integrity digests are off, so the figures isolate the
conversion. Medians; 1 GB = 1e9 bytes.
"""


GPU_DESCRIPTION = """\
GPU figures: engine step time and KV transfer GB/s, on models built on the spot with random
weights (tiny, or SmolLM2-135M's architecture), so nothing is downloaded.

engine: one engine in this process; per concurrency level c, c requests of --prompt-tokens
random token ids generate --max-tokens tokens each (ignore_eos), twice, the second pass
reported: TTFT and TPOT p50 (with every request decoding in lockstep, TPOT is the decode step
time at batch c), per --dtype, with and without CUDA graphs (--cuda-graphs on off).

transfer: a spawned prefill peer and a decode transceiver here, pools on the --devices given
(SRC:DST, e.g. cuda:cuda cpu:cuda), SmolLM2's KV layout; each size pulled at least 5 times and
for 0.5 s, GB/s at the median, integrity off and on, the bytes checked.

Prints one PDSERVE-GPU <json> line per result and a markdown table at the end.
"""


STRUCTURED_DESCRIPTION = """\
Structured outputs and tool calls against a running OpenAI-compatible server (--url: pdserve,
vLLM, ...): how many of --tries seeded requests return schema-valid tool calls (tool_choice
required), JSON that parses and validates (response_format json_schema) and streamed named
calls whose deltas join into valid arguments; ITL p50 under a json_schema vs unconstrained at
--concurrency; pdserve's grammar compile time per schema.
"""


SPECULATIVE_DESCRIPTION = """\
Speculative decoding without a draft model (--speculative-tokens K, n-gram prompt lookup)
against plain decoding, in-process engines, one greedy request at a time: for a copying
workload (repeat a text), an editing one and a chat one with nothing to copy, the TPOT and its
ratio to plain decoding, ITL p50, tokens per verifying step, the draft acceptance rate, and
whether the output equals plain decoding's (it must: exit status 1 otherwise).
"""


KV_DTYPE_DESCRIPTION = """\
KV storage dtypes side by side on one model (in-process engines, no server): the pool's blocks
for --kv-cache-mb, greedy answers to four chat prompts compared with the first dtype's, and the
decode step time of --batch sequences generating --tokens tokens together (FP8: fp8_e4m3,
fp8_e5m2).
"""


ROUTER_DESCRIPTION = """\
What the router adds to a request: a scripted worker (no model, --tokens NDJSON chunks at once)
and a real router in a child process; the same streamed requests straight to the worker's
request plane and through the router's /v1/completions, p50 latency of each and the difference
per --concurrency, and the router's completed requests per second.
"""


PAGED_ATTENTION_DESCRIPTION = """\
One layer's paged attention on SmolLM2-135M's layout (9 heads, 3 kv heads, head size 64, 16
tokens per block), random data, in this process: today's path (K/V store, index_select gather
of each sequence's blocks into a workspace, SDPA) against the C++ kernel that reads the blocks
in place (pdserve.workers.engine.model.paged_kernel, compiled at first use), for decode batches
(BxC: B sequences at C tokens of context) and one continued prefill chunk, float32 and
bfloat16. Prints the CPU, torch's threads, the median ms per call of each path, their ratio
and the largest difference between their outputs.
"""
