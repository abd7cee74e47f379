"""``pdserve bench gpu-proof``'s parts that need no GPU: a step overrunning its limit is stopped
(SIGINT, then SIGKILL to its whole process group), pytest's JUnit XML and ``bench gpu``'s result
lines are read back, and the summary states each of issue 29's targets as met, missed or not
decided from the figures. The stand-in model's tokenizer: every id decodes to text."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.engine.bench_models import byte_tokenizer
from pdserve.bench.gpu import bench_gpu_proof as proof
from pdserve.bench.gpu.bench_gpu_report import summary


def test_a_step_that_overruns_its_limit_is_interrupted(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    argv = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    t0 = time.monotonic()
    out = proof.run_step("engine", argv, log, timeout_s=1.0)
    assert (out.status, out.returncode) == ("timeout", None)
    assert time.monotonic() - t0 < 15  # SIGINT ended it well before the grace ran out
    assert "started" in log.read_text() and "killed after 1 s" in out.note


def test_a_step_is_interrupted_when_this_process_ignores_sigint(tmp_path: Path) -> None:
    """Started in the background of a script (``... &``), the bench ignores SIGINT; its step
    still gets SIGINT at its default, so the SIGINT ends it, not the SIGKILL 20 s later."""
    log = tmp_path / "step.log"
    argv = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t0 = time.monotonic()
        out = proof.run_step("engine", argv, log, timeout_s=1.0)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # this process: unchanged
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (out.status, out.returncode) == ("timeout", None)
    assert time.monotonic() - t0 < 15


def test_a_step_deaf_to_sigint_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proof, "GRACE_S", 0.5)
    pid_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
                                  "import signal, time; signal.signal(signal.SIGINT, "
                                  "signal.SIG_IGN); time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    out = proof.run_step("serve", [sys.executable, "-c", code], tmp_path / "s.log", timeout_s=2.0)
    assert out.status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (no longer listed, or a zombie waiting for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_failing_command_and_a_missing_program_are_outcomes_not_errors(tmp_path: Path) -> None:
    out = proof.run_step(
        "engine", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "a", 30
    )
    assert (out.status, out.returncode) == ("failed", 3)
    out = proof.run_step("engine", [str(tmp_path / "nope")], tmp_path / "b", 30)
    assert out.status == "error" and "FileNotFoundError" in out.note


def test_junit_outcomes_are_read_from_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent("""
        import pytest
        def test_ok(): pass
        def test_bad(): assert 1 == 2, "one is not two"
        @pytest.mark.skip(reason="needs a GPU")
        def test_skip(): pass
    """)
    )
    xml = tmp_path / "r.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
         "-o", "junit_family=xunit1", str(tmp_path / "test_x.py")],
        cwd=tmp_path, capture_output=True, check=False,
    )  # fmt: skip
    cases = {c["test"].split("::")[-1]: c for c in proof.junit_cases(xml)}
    assert {k: c["outcome"] for k, c in cases.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skip": "skipped"
    }  # fmt: skip
    assert "one is not two" in cases["test_bad"]["message"]
    assert "needs a GPU" in cases["test_skip"]["message"]
    assert proof.junit_cases(tmp_path / "missing.xml") == []


def test_bench_gpu_result_lines_are_parsed(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text('noise\nPDSERVE-GPU {"kind": "engine", "tpot_ms_p50": 4.5}\nmore\n')
    assert proof.gpu_results(log) == [{"kind": "engine", "tpot_ms_p50": 4.5}]


def _engine(c: int, graphs: bool, tpot: float, used: bool | None = None) -> dict[str, Any]:
    return {"kind": "engine", "model": "smollm2-like", "device": "NVIDIA H200",
            "dtype": "bfloat16", "cuda_graphs": graphs if used is None else used,
            "cuda_graphs_requested": graphs, "concurrency": c, "prompt_tokens": 256,
            "max_tokens": 32, "ttft_ms_p50": 20.0, "tpot_ms_p50": tpot,
            "decode_tokens_per_s": c / tpot * 1e3, "prefill_tokens_per_s": 12800.0}  # fmt: skip


def _transfer(blocks: int, integrity: bool, gbps: float) -> dict[str, Any]:
    return {"kind": "transfer", "backend": "nixl", "src": "cuda", "dst": "cuda",
            "integrity": integrity, "blocks": blocks, "mib": blocks * 0.703, "gbps_p50": gbps,
            "ms_p50": 1.0, "digest_compiled": ["cuda:0"] if gbps > 15 else []}  # fmt: skip


def _proof(tests: list[dict[str, Any]], engine: list[dict[str, Any]],
           transfer: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    serve_report = {"runs": [{"label": "disaggregated", "levels": [
        {"concurrency": 8, "num_requests": 32, "errors": 0, "first_error": None,
         "output_tokens_per_s": 900.0, "ttft_ms": {"p50": 30.0, "p90": 41.0},
         "itl_ms": {"p50": 6.1, "p90": 7.2}, "tpot_ms": {"p50": 6.3, "p90": 7.0}}]}]}  # fmt: skip
    steps = [
        {"step": "tests", "status": "ok", "seconds": 80.0, "note": "", "results": tests},
        {"step": "engine", "status": "ok", "seconds": 40.0, "note": "", "results": engine},
        {"step": "serve", "status": "ok", "seconds": 60.0, "note": "",
         "results": proof.serve_results(serve_report)},
        {"step": "transfer", "status": "ok", "seconds": 20.0, "note": "", "results": transfer},
    ]  # fmt: skip
    return {"args": {"input_len": 256, "output_len": 64, "stack_cuda_graphs": "on",
                     "dtype": "bfloat16"},
            "machine": {"gpu": "NVIDIA H200, 580.159.04, 143771 MiB", "cpu_model": "Xeon"},
            "steps": steps}  # fmt: skip


def _case(name: str, outcome: str, message: str = "") -> dict[str, Any]:
    return {"test": f"tests.gpu.{name}", "outcome": outcome, "message": message, "seconds": 1.0}


def test_the_summary_states_each_target_met() -> None:
    text = summary(_proof(
        [_case("test_cuda_graphs::test_a", "passed"), _case("test_cuda_graphs::test_b", "passed")],
        [_engine(1, False, 21.0), _engine(1, True, 3.9), _engine(8, False, 22.0),
         _engine(8, True, 4.4)],
        [_transfer(64, False, 20.0), _transfer(64, True, 18.0)],
    ))  # fmt: skip
    assert "CUDA graphs as the CUDA default: yes: all 2 graph tests passed" in text
    assert "batch 1 with CUDA graphs <= 5 ms (bfloat16): met: 3.90 ms" in text
    assert "nixl digests on >= 0.8x off at 64 blocks: met: 0.90x" in text
    assert "mix64 on the GPU, compiled kernel on cuda:0" in text
    assert "| bfloat16 | 1 | 21.00 | 3.90 | 5.38x |" in text  # graphs off / on per batch
    assert "| disaggregated | 8 | 32 | 0 | 30.0 / 41.0 | 6.10 / 7.20 | 6.30 | 900 |" in text
    assert "NVIDIA H200, 580.159.04" in text and "2 passed" in text


def test_the_summary_states_misses_with_their_figures() -> None:
    text = summary(_proof(
        [_case("test_cuda_graphs::test_a", "failed", "tokens differ at 7"),
         _case("test_engine_cuda::test_c", "skipped", "needs nixl")],
        [_engine(1, True, 7.25)],
        [_transfer(64, False, 20.0), _transfer(64, True, 10.0)],
    ))  # fmt: skip
    assert (
        "CUDA graphs as the CUDA default: no: `tests.gpu.test_cuda_graphs::test_a` failed" in text
    )
    assert "- failed: `tests.gpu.test_cuda_graphs::test_a`: tokens differ at 7" in text
    assert "- skipped (1): needs nixl" in text
    assert "(bfloat16): MISSED: 7.25 ms" in text
    assert "at 64 blocks: MISSED: 0.50x (10.00 / 20.00 GB/s)" in text
    assert "mix64 on the GPU, compiled kernel on cuda:0" in text  # any run's, as one line


def test_graphs_asked_for_but_not_used_are_not_taken_for_a_measurement() -> None:
    text = summary(_proof(
        [_case("test_cuda_graphs::test_a", "skipped", "needs a CUDA GPU")],
        [_engine(1, False, 0.7), _engine(1, True, 0.69, used=False)],
        [],
    ))  # fmt: skip
    assert "not decided: 1 of 1 graph tests skipped" in text
    assert "decode step at batch 1 <= 5 ms: not measured" in text
    assert "the graphs on column ran eager" in text


def test_the_stand_in_tokenizer_has_the_vocabulary_size_and_every_id_is_text() -> None:
    tok = byte_tokenizer(49152)
    assert len(tok) == 49152
    specials = set(tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>", "<|turn|>"]))
    assert specials == {49148, 49149, 49150, 49151}
    assert all(tok.decode([i]).strip() for i in range(256, 49148, 97))  # merged tokens: visible
    text = "Disaggregated serving moves KV cache blocks!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges apply
    assert len(byte_tokenizer()) == 260
    with pytest.raises(ValueError):
        byte_tokenizer(259)
    assert json.dumps(tok.get_vocab()["!!"]) == "256"  # the first merge follows the bytes


def test_a_step_that_raises_is_an_error_and_the_next_step_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.cli import build_parser

    def broken(*_: Any) -> proof.StepOutcome:
        raise RuntimeError("no model folder")

    def fine(*_: Any) -> proof.StepOutcome:
        return proof.StepOutcome("transfer", seconds=1.0, results=[_transfer(1, False, 2.0)])

    monkeypatch.setitem(proof._STEP_RUNNERS, "serve", broken)
    monkeypatch.setitem(proof._STEP_RUNNERS, "transfer", fine)
    args = build_parser().parse_args(
        ["bench", "gpu-proof", "--out", str(tmp_path), "--steps", "serve", "transfer",
         "--device", "cpu"]
    )  # fmt: skip
    assert proof.run(args) == 1
    steps = json.loads((tmp_path / "proof.json").read_text())["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [("serve", "error"), ("transfer", "ok")]
    text = (tmp_path / "summary.md").read_text()
    assert "| serve | error | 0 | RuntimeError: no model folder |" in text
    assert "| nixl | cuda -> cuda | 1 |" in text
