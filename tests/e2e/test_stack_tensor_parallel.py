"""Tensor parallel workers through the whole stack: greedy tokens equal TP=1's for every split.

One stack (router + worker processes, each TP worker with its rank processes) per model. The
completions are first served by a TP=1 prefill and TP=1 decode worker; then workers are swapped
one at a time (the new one registers before the old one drains), so that each prefill TP=m ->
decode TP=n pair below serves the same prompts, and every pair must give TP=1's tokens. The
prefill worker's Formatter maps the KV heads between the rank layouts (split, merge, replicated
heads) on the transfer backend the stack picks (every backend moves mapped layouts in
``tests/integration/test_transfer_tensor_parallel.py``).

- tiny random Llama (4 query heads, 2 KV heads): (1,2), (2,2), (2,1), (2,4), (4,2); at TP=4
  each KV head lives on two ranks.
- SmolLM2-135M (9 query heads, 3 KV heads; slow): (1,3), (3,3), (3,1); TP=2 is refused.

Every worker runs eagerly (``--no-compile``; TP workers always do), so TP=1 and TP=N differ
only in how the sums of the row-parallel layers are split.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack

TINY_PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    list(range(40, 90)),
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110] * 3,
]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def _tp(stack: Stack) -> dict[str, int]:
    return {r["worker_id"]: r["layout"].get("tp_size", 1) for r in stack.registry_workers()}


def _swap(stack: Stack, role: str, new: str, tp: int, old: str) -> None:
    """Start ``new`` (``role``, TP=``tp``), wait until it serves, then stop ``old`` (SIGTERM:
    it deregisters first) and wait until the registry no longer holds it."""
    stack.start_worker(role, new, ("--tensor-parallel-size", str(tp)))
    wait_until_sync(lambda: new in _tp(stack), 120.0, interval_s=0.2, what=f"{new} to register")
    stack.wait_ready(len(_tp(stack)))
    stack.procs[old].kill(signal.SIGTERM)
    wait_until_sync(lambda: old not in _tp(stack), 60.0, interval_s=0.2, what=f"{old} to leave")
    assert _tp(stack)[new] == tp


def _stack(model_dir: Path, name: str, log_dir: Path) -> Stack:
    stack = Stack(
        model_dir=model_dir,
        served_model_name=name,
        log_dir=log_dir,
        extra_worker_args=("--no-compile",),
    )
    stack.start_router()
    stack.start_worker("prefill", "p-tp1", ("--tensor-parallel-size", "1"))
    stack.start_worker("decode", "d-tp1", ("--tensor-parallel-size", "1"))
    stack.wait_ready(2)
    return stack


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = _stack(tiny_model_dir, "tiny-llama", tmp_path_factory.mktemp("tp-tiny"))
    try:
        yield stack
    finally:
        stack.stop()


def _complete(stack: Stack, model: str, prompt: list[int] | str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0, timeout=120)
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].text  # type: ignore[no-any-return]


def test_tiny_model_tensor_parallel_pairs_equal_tp1(tiny: Stack) -> None:
    def texts() -> list[str]:
        return [_complete(tiny, "tiny-llama", p, 20) for p in TINY_PROMPTS]

    assert _tp(tiny) == {"p-tp1": 1, "d-tp1": 1}
    reference = texts()
    assert all(reference)  # real completions
    steps = [
        ("decode", "d-tp2", 2, "d-tp1"),  # (1, 2)
        ("prefill", "p-tp2", 2, "p-tp1"),  # (2, 2)
        ("decode", "d-tp1b", 1, "d-tp2"),  # (2, 1)
        ("decode", "d-tp4", 4, "d-tp1b"),  # (2, 4): replicated KV heads on the decode side
        ("prefill", "p-tp4", 4, "p-tp2"),  # (4, 4)
        ("decode", "d-tp2b", 2, "d-tp4"),  # (4, 2): out of replicated heads
    ]
    for role, new, tp, old in steps:
        _swap(tiny, role, new, tp, old)
        layouts = _tp(tiny)
        assert texts() == reference, f"prefill/decode TP {sorted(layouts.items())}"


def _rank_pids(worker_pid: int) -> list[int]:
    """The spawned rank processes of a worker (children running multiprocessing's spawn_main;
    any of the worker's threads may have started them, so every thread's children count)."""
    pids = []
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(child))
    return pids


def test_a_dead_rank_takes_its_worker_down(tiny: Stack) -> None:
    """Kill one rank of a TP=2 decode worker: the worker stops itself with a non-zero exit
    (the supervisor of ``pdserve up`` restarts such a worker) and leaves the registry."""
    name = "d-doomed"
    tiny.start_worker("decode", name, ("--tensor-parallel-size", "2"))
    wait_until_sync(lambda: name in _tp(tiny), 120.0, interval_s=0.2, what=f"{name} to register")
    worker = tiny.procs[name]
    ranks = _rank_pids(worker.pid)
    assert len(ranks) == 1, ranks
    os.kill(ranks[0], signal.SIGKILL)
    worker.popen.wait(60)
    assert worker.returncode not in (0, None)
    wait_until_sync(lambda: name not in _tp(tiny), 60.0, interval_s=0.2, what=f"{name} to leave")
    assert "tensor parallel rank 1" in worker.log()


def test_indivisible_tensor_parallel_size_is_refused_before_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """TP=3 over the tiny model's 4 attention heads: the worker exits with a message that
    names the heads, before it starts a rank or registers."""
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(tiny_model_dir),
         "--tensor-parallel-size", "3", "--no-compile", "--cluster-secret-file", str(secret)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in proc.stderr
    assert "started ranks" not in proc.stderr


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    stack = _stack(smollm2_dir, "smollm2", tmp_path_factory.mktemp("tp-smol"))
    try:

        def texts() -> list[str]:
            return [_complete(stack, "smollm2", p, 16) for p in SMOL_PROMPTS]

        reference = texts()
        assert all(reference)
        for role, new, tp, old in [
            ("decode", "d-tp3", 3, "d-tp1"),  # (1, 3): each decode rank gets its one KV head
            ("prefill", "p-tp3", 3, "p-tp1"),  # (3, 3): TP=3 through the whole stack
            ("decode", "d-tp1b", 1, "d-tp3"),  # (3, 1): three shards merge
        ]:
            _swap(stack, role, new, tp, old)
            assert texts() == reference, f"TP {sorted(_tp(stack).items())}"
    finally:
        stack.stop()
