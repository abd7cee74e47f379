"""Every benchmark is a ``pdserve bench`` subcommand with a helpful ``--help``, and building the
command line imports no benchmark's heavy dependencies (torch, httpx)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.bench.bench_commands import BY_NAME, COMMANDS
from pdserve.cli import build_parser

TRANSFER_HELP = (
    "--backends", "--integrity", "raw-socket", "memcpy", "--tp-pairs", "--profile",
    "--profile-pulls", "100 us", "0.9x", "0.7x", "0.8x", "16 MiB", "not measured", "us per pull",
)  # fmt: skip
HANDOFF_HELP = (
    "--prompt-tokens", "--requests", "--backend", "--config", "TT2T", "second token", "0.9x",
    "1.05x", "hardly moves",
)  # fmt: skip
HELP = {
    "serve": ("--url", "--concurrency", "TTFT", "--config", "--compile", "--plot", "--plot-with"),
    "transfer": TRANSFER_HELP,
    "router": ("--concurrency", "--requests", "scripted worker", "difference"),
    "kv-dtype": ("--kv-dtypes", "--kv-cache-mb", "--batch", "fp8_e4m3"),
    "multiturn": (
        "--conversations",
        "--compare",
        "--prefill-workers",
        "--decode-workers",
        "--config",
        "hit rate",
        "x-session-id",
    ),  # fmt: skip
    "fairness": (
        "--flood-concurrency",
        "--probe-requests",
        "--max-requests-per-worker",
        "--config",
        "1.5x",
        "tenants",
    ),  # fmt: skip
    "kv-restart": ("--prompt-tokens", "--disk-dir", "--tier", "--config", "0.5x", "disk tier"),
    "kv-migrate": ("--kill-after", "--remote-cache", "--config", "0.3x", "SIGKILL"),
    "kv-peer": ("--prompt-tokens", "--max-tokens", "--config", "0.3x", "colocated"),
    "handoff": HANDOFF_HELP,
    "compile": ("--threads", "--rounds", "--skip-startup", "eager", "torch.compile"),
    "formatter": ("--tokens", "--backends", "--threads", "staging"),
    "paged-attention": ("--dtypes", "--threads", "SDPA"),
    "speculative": ("--speculative-tokens", "--workloads", "TPOT", "acceptance"),
    "decode-floor": ("--dtypes", "--batches", "--threads", "--profile", "read bandwidth"),
    "profile": (
        "--threads",
        "--prefill-tokens",
        "--batches",
        "--contexts",
        "--mixed",
        "--out",
        "--config",
        "pdserve plan",
    ),
    "plan-check": ("--profile", "--configs", "--workloads", "--concurrency", "PxD", "simulated"),
    "autoscale": ("--phases", "--fixed", "--arms", "worker-seconds", "--config", "--input-len"),
    "gpu": ("engine", "transfer", "random", "PDSERVE-GPU"),
    "gpu engine": ("--device", "--dtype", "--cuda-graphs", "smollm2-like"),
    "gpu transfer": ("--backends", "--devices", "--blocks"),
    "gpu-proof": ("--steps", "--out", "$OUT", "summary.md", "--timeout-scale", "smollm2-like"),
}


def test_every_benchmark_is_a_subcommand() -> None:
    assert [c.name for c in COMMANDS] == [
        "serve", "transfer", "multiturn", "fairness", "kv-restart", "kv-migrate", "kv-peer",
        "handoff",
        "compile", "formatter",
        "structured", "kv-dtype", "router", "paged-attention", "speculative", "decode-floor",
        "profile", "plan-check", "autoscale", "gpu", "gpu-proof",
    ]  # fmt: skip
    assert {c.settings for c in COMMANDS} == {"none", "config", "flags"}
    assert BY_NAME["serve"].settings == "flags" and BY_NAME["multiturn"].settings == "config"


@pytest.mark.parametrize("command", list(HELP))
def test_help_describes_each_benchmark(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *command.split(), "--help"])
    text = capsys.readouterr().out
    for fragment in HELP[command]:
        assert fragment in text, fragment


def test_the_options_parse_with_their_defaults() -> None:
    args = build_parser().parse_args(["bench", "multiturn", "--compare", "routing"])
    assert (args.conversations, args.turns, args.prefill_workers) == (8, 4, 2)
    args = build_parser().parse_args(["bench", "kv-restart"])
    assert (args.prompt_tokens, args.max_tokens, args.disk_dir) == (4000, 8, None)
    args = build_parser().parse_args(["bench", "handoff"])
    assert (args.prompt_tokens, args.requests, args.backend) == ([512, 2048, 8000], 3, None)
    args = build_parser().parse_args(["bench", "gpu", "transfer", "--blocks", "1", "4"])
    assert (args.what, args.blocks, args.devices) == ("transfer", [1, 4], ["cuda:cuda"])
    args = build_parser().parse_args(["bench", "transfer"])
    assert (args.backends, args.profile, args.profile_pulls) == (None, False, 2000)
    args = build_parser().parse_args(["bench", "transfer", "--profile", "--backends", "tcp"])
    assert (args.backends, args.profile) == (["tcp"], True)
    args = build_parser().parse_args(["bench", "gpu-proof"])
    assert (args.steps, args.dtype, args.concurrency) == (
        ["tests", "engine", "serve", "transfer"], "bfloat16", [1, 8, 32])  # fmt: skip
    args = build_parser().parse_args(["bench", "compile", "--threads", "2"])
    assert (args.threads, args.rounds, args.model) == ([2], 7, None)


def test_building_the_command_line_imports_no_benchmark() -> None:
    code = (
        "import sys; from pdserve.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'httpx', 'pdserve.bench.gpu.bench_gpu', "
        "'pdserve.bench.serving.bench_multiturn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
