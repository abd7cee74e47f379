"""``pdserve bench gpu-proof``: everything a session lent a GPU machine must run, in one call.

A GPU machine is lent now and then, for about 15 minutes of device time, start-up included, and
its output comes back as at most 8 files. This command runs the checks that prove the CUDA path
one after another, each in its own process under its own time limit, and writes what they found
into ``--out`` (default ``$OUT``, the folder such a machine sends back):

1. ``tests``: ``pytest tests/gpu`` (engine fidelity on CUDA, CUDA graphs against eager and
   ``generate()``, KV transfer VRAM -> VRAM over NIXL with integrity on, mixed CPU <-> CUDA
   pairs, the newer engine paths); the outcome of every test, from pytest's JUnit XML;
2. ``engine``: ``pdserve bench gpu engine`` on the SmolLM2-architecture stand-in
   (:func:`pdserve.bench.engine.bench_models.build_smollm2_like`: SmolLM2's weights cannot be carried
   to the GPU machine, which has no network) with CUDA graphs on and off: decode step (TPOT) at
   each batch size, TTFT, prefill tokens/s;
3. ``serve``: ``pdserve bench serve`` on the stand-in (a 1 prefill + 1 decode stack, then one
   colocated worker): TTFT, ITL and output tokens/s per concurrency level;
4. ``transfer``: ``pdserve bench gpu transfer`` between pools on the device, integrity digests
   off and on: GB/s per request size.

Files written: ``summary.md`` (the tables docs/benchmarks.md takes, the targets met or missed,
the verdict on CUDA graphs), ``proof.json`` (the machine, every step's outcome and figures),
and one ``<step>.log`` per step (its whole output; a failed stack's worker logs appended). A
step that overruns its limit gets SIGINT (so a stack it started stops its workers), then
SIGKILL to its process group 20 s later; the next step runs regardless. Exit status 0 when
every step finished and no test failed, else 1.

``.ci/gpu`` wraps it for the device machine (unpacks the packages the machine lacks, which
``.ci/gpu-site`` prepares here). ``--device cpu --model tiny`` checks the plumbing without a GPU.
Benchmark code only: the serving path never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
Run the GPU proof in one call, each step in its own process under its own time limit: the GPU
tests (pytest tests/gpu), engine decode step / TTFT / prefill tokens/s with CUDA graphs on and
off, a 1 prefill + 1 decode stack against a colocated worker (TTFT, ITL, tokens/s per
concurrency), KV transfer GB/s with integrity digests off and on. Models: random weights with
SmolLM2-135M's architecture and vocabulary size (nothing to download). Writes summary.md,
proof.json and one log per step into --out (default $OUT). Exit 0 when every step finished and
no test failed.
"""
"""The ``pdserve bench gpu-proof --help`` text."""
HELP = "the CUDA proof in one call: GPU tests, engine, stack and transfer figures, summary.md"
"""The one line ``pdserve bench --help`` lists."""

STEPS = ("tests", "engine", "serve", "transfer")
"""The steps, in the order they run."""
TIMEOUTS_S = {"tests": 220.0, "engine": 90.0, "serve": 140.0, "transfer": 50.0}
"""Each step's default time limit (seconds): 500 s together, inside one 600-s device call."""
GRACE_S = 20.0
"""Seconds between the SIGINT to a step that overran its limit and the SIGKILL."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench gpu-proof``."""
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for summary.md, proof.json and the logs (default: $OUT, else ./gpu-proof)",
    )
    p.add_argument(
        "--steps",
        nargs="+",
        choices=STEPS,
        default=list(STEPS),
        help="steps to run (default: all, in the order tests engine serve transfer)",
    )
    p.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    p.add_argument(
        "--model",
        choices=["smollm2-like", "tiny"],
        default="smollm2-like",
        help="engine stand-in model (default: smollm2-like; the stack always runs smollm2-like)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="engine batch sizes and stack concurrency levels (default: 1 8 32)",
    )
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default: 256)")
    p.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="output tokens per stack request (default: 64; the engine step: 32)",
    )
    p.add_argument(
        "--stack-cuda-graphs",
        choices=["on", "off"],
        default="on",
        help="the stack's workers with CUDA graphs or without (default: on)",
    )
    p.add_argument(
        "--transfer-backends",
        nargs="+",
        default=["nixl", "tcp"],
        help="KV transfer backends (default: nixl tcp)",
    )
    p.add_argument(
        "--transfer-blocks",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="pull sizes in KV blocks (default: 1 16 64)",
    )
    p.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="multiply every step's time limit (defaults: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in TIMEOUTS_S.items())
        + ")",
    )


@dataclass
class StepOutcome:
    """One step's run: ``status`` ``ok`` (exit 0), ``failed`` (another exit status), ``timeout``
    (killed at its limit) or ``error`` (could not start); ``seconds`` wall time; ``log`` the
    file holding its output; ``results`` what it measured (step-specific dicts)."""

    step: str
    status: str = "ok"
    returncode: int | None = 0
    seconds: float = 0.0
    log: str = ""
    note: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)


def run_step(
    step: str,
    argv: list[str],
    log: Path,
    timeout_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> StepOutcome:
    """Run ``argv`` (in ``cwd``, with ``env`` over this environment) in a new process group,
    stdout and stderr into ``log``; past ``timeout_s`` SIGINT the group, SIGKILL it
    :data:`GRACE_S` later. Never raises for the child's failure."""
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        try:
            proc = _spawn(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=cwd,
                env={**os.environ, **(env or {})},
            )
        except OSError as exc:
            return StepOutcome(step, "error", None, 0.0, log.name, f"{type(exc).__name__}: {exc}")
        try:
            rc: int | None = proc.wait(timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status, rc = "timeout", None
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
    note = f"killed after {timeout_s:.0f} s" if status == "timeout" else ""
    return StepOutcome(step, status, rc, time.monotonic() - t0, log.name, note)


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` whose child starts with SIGINT at its default even
    when this process ignores SIGINT. A command started in the background of a script
    (``pdserve bench gpu-proof ... &``) ignores SIGINT, and an ignored signal stays ignored
    across exec, so the step's SIGINT would do nothing and only the SIGKILL :data:`GRACE_S`
    later would stop it (a stack it started would not stop its workers). While the child is
    spawned, SIGINT is caught by a no-op here instead (still no effect on this process); a
    caught signal is reset to its default by exec. Only the main thread can change handlers:
    elsewhere the child inherits what this process has."""
    if (
        signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        or threading.current_thread() is not threading.main_thread()
    ):
        return subprocess.Popen(argv, **kwargs)
    signal.signal(signal.SIGINT, _ignore_signal)
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ignore_signal(signum: int, frame: object) -> None:
    """A handler that does nothing (see :func:`_spawn`)."""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def gpu_results(log: Path) -> list[dict[str, Any]]:
    """The ``PDSERVE-GPU <json>`` results ``pdserve bench gpu`` printed into ``log``."""
    from pdserve.bench.gpu.bench_gpu import RESULT_PREFIX

    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_PREFIX):
            out.append(json.loads(line[len(RESULT_PREFIX) :]))
    return out


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Every test case of a pytest JUnit XML file: ``{"test", "outcome", "message",
    "seconds"}`` with outcome ``passed``, ``failed``, ``error`` or ``skipped``; [] when the
    file is missing or unreadable (a run killed before it wrote one)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                first = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = first[0][:300] if first else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append(
            {
                "test": name,
                "outcome": outcome,
                "message": message,
                "seconds": float(case.get("time") or 0.0),
            }
        )
    return cases


def serve_results(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run and level of a ``pdserve bench serve --json`` report, without the raw
    samples: label, concurrency, requests, errors, output tokens/s, TTFT/ITL/TPOT p50 and p90."""
    rows = []
    for run in report.get("runs", []):
        for lv in run.get("levels", []):
            row = {
                "label": run.get("label"),
                "concurrency": lv.get("concurrency"),
                "requests": lv.get("num_requests"),
                "errors": lv.get("errors"),
                "first_error": lv.get("first_error"),
                "output_tokens_per_s": lv.get("output_tokens_per_s"),
            }
            for m in ("ttft", "itl", "tpot"):
                for p in ("p50", "p90"):
                    row[f"{m}_ms_{p}"] = (lv.get(f"{m}_ms") or {}).get(p)
            rows.append(row)
    return rows


def machine_facts(device: str) -> dict[str, Any]:
    """The machine the figures came from: GPU name, driver and memory (nvidia-smi), torch and
    its CUDA, transformers and NIXL versions, CPU model and cores, the git revision."""
    import importlib.metadata as md

    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for dist in ("torch", "transformers", "nixl", "nixl-cu13", "nixl-cu12"):
        try:
            facts[dist] = md.version(dist)
        except md.PackageNotFoundError:
            facts[dist] = None
    try:
        facts["cpu_model"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        facts["cpu_model"] = platform.processor() or None
    facts["gpu"] = _nvidia_smi()
    import torch

    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(torch.device(device))
    facts["git"] = _quiet(["git", "rev-parse", "--short", "HEAD"])
    return facts


def _nvidia_smi() -> str | None:
    return _quiet(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )


def _quiet(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def _tests_dir() -> Path | None:
    """tests/gpu of the checkout: under the working directory (``.ci/gpu`` runs from the
    repository root), else beside an editable install's package."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "tests" / "gpu").is_dir():
            return root / "tests" / "gpu"
    return None


def _append_logs(log: Path, folder: Path) -> None:
    """Append the last 60 lines of every ``*.log`` under ``folder`` to ``log``."""
    with log.open("a") as f:
        for path in sorted(folder.rglob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-60:]
            f.write(f"\n===== {path.relative_to(folder)} (last {len(lines)} lines) =====\n")
            f.write("\n".join(lines) + "\n")


def run(args: argparse.Namespace, cfg: PdserveConfig | None = None) -> int:
    """``pdserve bench gpu-proof``: every ``--steps`` step, then summary.md and proof.json in
    ``--out``; 0 when every step finished and no test failed, else 1."""
    out = Path(args.out or os.environ.get("OUT") or "gpu-proof").resolve()
    out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts(args.device)
    print(
        f"gpu-proof: {facts.get('device_name') or facts.get('cpu_model')}; writing {out}",
        flush=True,
    )
    outcomes: list[StepOutcome] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-proof-") as tmp:
        work = Path(tmp)
        for step in args.steps:
            limit = TIMEOUTS_S[step] * args.timeout_scale
            print(f"gpu-proof: {step} (limit {limit:.0f} s) ...", flush=True)
            try:
                outcome = _STEP_RUNNERS[step](args, work, out / f"{step}.log", limit)
            except Exception as exc:  # noqa: BLE001 - a step's own failure must not stop the rest
                outcome = StepOutcome(step, "error", None, 0.0, "", f"{type(exc).__name__}: {exc}")
            print(
                f"gpu-proof: {step} {outcome.status} in {outcome.seconds:.0f} s"
                + (f" ({outcome.note})" if outcome.note else ""),
                flush=True,
            )
            outcomes.append(outcome)
    proof = {
        "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
        },
        "machine": facts,
        "steps": [asdict(o) for o in outcomes],
    }
    (out / "proof.json").write_text(json.dumps(proof, indent=2, default=str) + "\n")
    from pdserve.bench.gpu.bench_gpu_report import summary

    text = summary(proof)
    (out / "summary.md").write_text(text)
    print(text, flush=True)
    failed = any(o.status != "ok" for o in outcomes) or any(
        c["outcome"] in ("failed", "error")
        for o in outcomes
        if o.step == "tests"
        for c in o.results
    )
    return int(failed)


def _step_tests(args: argparse.Namespace, work: Path, log: Path, limit: float) -> StepOutcome:
    folder = _tests_dir()
    if folder is None:
        return StepOutcome("tests", "error", None, 0.0, "", "no tests/gpu beside this pdserve")
    xml = work / "tests.xml"
    # one module that fails to import must not stop the others
    argv = [
        sys.executable,
        "-m",
        "pytest",
        str(folder),
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
        "--continue-on-collection-errors",
    ]
    outcome = run_step("tests", argv, log, limit, cwd=folder.parents[1])
    outcome.results = junit_cases(xml)
    if not outcome.results and outcome.status == "ok":
        outcome.status, outcome.note = "failed", "pytest wrote no test cases"
    return outcome


def _step_engine(args: argparse.Namespace, work: Path, log: Path, limit: float) -> StepOutcome:
    argv = _cli(
        "bench",
        "gpu",
        "engine",
        "--device",
        args.device,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--cuda-graphs",
        "off",
        "on",
        "--prompt-tokens",
        str(args.input_len),
        "--max-tokens",
        "32",
        "--concurrency",
        *map(str, args.concurrency),
    )
    outcome = run_step("engine", argv, log, limit)
    outcome.results = gpu_results(log)
    return outcome


def _step_serve(args: argparse.Namespace, work: Path, log: Path, limit: float) -> StepOutcome:
    from pdserve.bench.engine.bench_models import build_smollm2_like

    t0 = time.monotonic()
    model = build_smollm2_like(work / "smollm2-like", seed=0)
    built_s = time.monotonic() - t0
    report = work / "serve.json"
    graphs = "--cuda-graphs" if args.stack_cuda_graphs == "on" else "--no-cuda-graphs"
    argv = _cli(
        "bench",
        "serve",
        "--model",
        str(model),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        graphs,
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--concurrency",
        *map(str, args.concurrency),
        "--json",
        str(report),
    )
    stack_tmp = work / "stack-tmp"  # the stacks' log folders land here
    stack_tmp.mkdir()
    outcome = run_step(
        "serve", argv, log, max(1.0, limit - built_s), env={"TMPDIR": str(stack_tmp)}
    )
    outcome.seconds += built_s
    try:
        outcome.results = serve_results(json.loads(report.read_text()))
    except (OSError, ValueError):
        outcome.results = []
    if outcome.status != "ok" or not outcome.results:
        _append_logs(log, stack_tmp)
    return outcome


def _step_transfer(args: argparse.Namespace, work: Path, log: Path, limit: float) -> StepOutcome:
    argv = _cli(
        "bench",
        "gpu",
        "transfer",
        "--backends",
        *args.transfer_backends,
        "--devices",
        f"{args.device}:{args.device}",
        "--blocks",
        *map(str, args.transfer_blocks),
    )
    outcome = run_step("transfer", argv, log, limit)
    outcome.results = gpu_results(log)
    return outcome


_STEP_RUNNERS = {
    "tests": _step_tests,
    "engine": _step_engine,
    "serve": _step_serve,
    "transfer": _step_transfer,
}
