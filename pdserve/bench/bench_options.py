"""The options and the description of ``pdserve bench serve`` and ``pdserve bench transfer``.

The CLI builds these two subcommands' options from here (:mod:`pdserve.bench.bench_commands`
adds ``transfer --profile``); what runs them is :mod:`pdserve.bench.bench`. Importing this module
is light (argparse only).
"""

from __future__ import annotations

import argparse

SERVE_DESCRIPTION = """\
With --url: drive an already running OpenAI-compatible server (pdserve, vLLM, ...) with a
fixed-seed synthetic chat workload: prompts of --input-len tokens (random words, chat template
applied, counted with --tokenizer), --output-len tokens per request (streaming, greedy,
ignore_eos), a closed loop of N requests in flight for each --concurrency level, one warm-up
request first (not counted). Without --url: start pdserve itself (router + 1 prefill + 1 decode,
then one colocated worker) and compare the two on token-id prompts.

Reported per level (ms): TTFT (send -> first content delta), ITL (gaps between content deltas),
TPOT ((e2e - TTFT) / (output tokens - 1)), e2e (send -> end of stream), each as mean, p50, p90,
p99; output tokens/s over the level's wall time; request errors (count and first message).
--json also keeps each level's raw TTFT and ITL samples (seconds). --plot PATH.png draws them:
TTFT and ITL distributions (ECDFs) per run and level, output tokens/s against concurrency, one
line per run (disaggregated and colocated; with --plot-with, the runs of earlier --json files).
"""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench serve``."""
    p.add_argument(
        "--url",
        default=None,
        help="OpenAI-compatible base URL of a running server, e.g. http://127.0.0.1:8100/v1 "
        "(default: start pdserve itself and compare disaggregated vs colocated)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="with --url: the model name sent in requests (default: the first id of GET "
        "/v1/models); without --url: the local model folder pdserve starts (default: SmolLM2)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer folder used to build prompts of exactly --input-len tokens (default: "
        "--model when it is a folder, else the converted SmolLM2 folder in the cache)",
    )
    p.add_argument(
        "--input-len",
        "--prompt-tokens",
        dest="input_len",
        type=int,
        default=256,
        help="prompt tokens per request, chat template included (default: 256)",
    )
    p.add_argument(
        "--output-len",
        "--max-tokens",
        dest="output_len",
        type=int,
        default=64,
        help="output tokens per request, sent as max_tokens (default: 64); 0 sends no "
        "max_tokens, as a plain chat client does (give --no-ignore-eos with it)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8],
        help="requests in flight; several levels run one after another (default: 1 8)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        metavar="REQ_PER_S",
        help="open loop instead of --concurrency: send requests at Poisson arrivals of this "
        "rate (requests/s, seeded by --seed) whatever is in flight; several rates run one "
        "after another",
    )
    p.add_argument(
        "--num-requests",
        "--requests",
        dest="num_requests",
        type=int,
        default=None,
        help="requests per level (default: max(16, 4 x concurrency); with --request-rate "
        "max(16, 10 s of arrivals))",
    )
    for metric, what in (
        ("ttft", "time to first token"),
        ("tpot", "time per output token after the first (the request's mean)"),
        ("itl", "inter-token latency (the request's 90th percentile gap)"),
    ):
        p.add_argument(
            f"--{metric}-slo-ms",
            type=float,
            default=None,
            metavar="MS",
            help=f"SLO target for {what}, ms: with any --*-slo-ms, each level also reports "
            "goodput, the rate and share of requests meeting every target given",
        )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument(
        "--prompt-file",
        default=None,
        metavar="FILE",
        help="with --url: user messages, one per line, used in turn instead of synthetic "
        "prompts (--input-len is then ignored), e.g. docs/bench/chat-questions.txt",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so every request produces exactly --output-len tokens (default: on)",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="warm-up requests, not counted (default: 1)"
    )
    p.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="per-request timeout, seconds"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--label", default=None, help="name of this run in the tables and the JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="also draw a PNG (needs matplotlib: pip install 'pdserve[plot]'): the TTFT and ITL "
        "distributions (ECDFs, ms) of each run and concurrency level, and output tokens/s "
        "against concurrency, one line per run (without --url: disaggregated and colocated)",
    )
    p.add_argument(
        "--plot-with",
        nargs="+",
        default=[],
        metavar="FILE.json",
        help="with --plot: also draw the runs of earlier --json reports (e.g. another server's) "
        "beside this one's",
    )
    p.add_argument(
        "--json-schema",
        action="store_true",
        help="with --url: every request under response_format json_schema (one string of about "
        "3 x --output-len characters, so about --output-len tokens) to measure the grammar's "
        "cost against a run without it; ignore_eos is not sent (the grammar ends the output)",
    )
    # Without --url, the started stack takes the settings: --config, PDSERVE_* variables and
    # the setting flags pdserve.cli adds to this command (--transfer-backend, --compile, ...).


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench transfer``."""
    p.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=None,
        help="request sizes in MiB, rounded up to whole KV blocks (default: 1 block .. 64 MiB)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["tcp", "nixl", "ucx"],
        help="cases: tcp nixl-tcp nixl-shm ucx-tcp ucx-shm (nixl, ucx: both of theirs)",
    )
    p.add_argument(
        "--integrity",
        choices=["off", "on", "both"],
        default="both",
        help="KV digests during the backend runs (default: both, side by side)",
    )
    p.add_argument("--min-seconds", type=float, default=0.3, help="measuring time per size")
    p.add_argument("--rounds", type=int, default=1, help="measure everything N times, pooled")
    p.add_argument(
        "--tp-pairs",
        nargs="+",
        default=None,
        metavar="M:N",
        help="also hand off from a prefill pool split over M tensor parallel ranks into a "
        "decode pool split over N (e.g. 1:3 3:1 3:3 on SmolLM2's 3 KV heads), each compared "
        "with the unmapped hand-off of the same bytes",
    )
