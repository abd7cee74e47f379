"""The summary of ``pdserve bench gpu-proof`` (:mod:`pdserve.bench.gpu.bench_gpu_proof`): markdown
tables ready for docs/benchmarks.md, the targets of issue 29 met or missed with the figures, and
the verdict on CUDA graphs as the CUDA default.

Pure: reads the ``proof.json`` dict, imports nothing heavy. Benchmark code only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TPOT_TARGET_MS = 5.0
"""The batch-1 decode step with CUDA graphs must take at most this long, ms."""
DIGEST_TARGET = 0.8
"""KV transfer GB/s with integrity digests on, as a share of digests off, at the largest size."""
GRAPH_TESTS = "test_cuda_graphs"
"""The test module whose passing makes CUDA graphs fit to be the CUDA default."""


def summary(proof: dict[str, Any]) -> str:
    """``proof.json`` (``{"args", "machine", "steps"}``, as ``gpu-proof`` writes it) as markdown:
    the machine, the steps, the tests, the engine, the stack, the transfers, the verdicts."""
    steps = {s["step"]: s for s in proof.get("steps", [])}
    parts = [_machine(proof.get("machine", {})), _steps(steps.values())]
    if "tests" in steps:
        parts.append(_tests(steps["tests"]["results"]))
    if "engine" in steps:
        parts.append(_engine(steps["engine"]["results"]))
    if "serve" in steps:
        parts.append(_serve(steps["serve"]["results"], proof.get("args", {})))
    if "transfer" in steps:
        parts.append(_transfer(steps["transfer"]["results"]))
    parts.append(_verdicts(steps))
    return "\n\n".join(p for p in parts if p) + "\n"


def _machine(m: dict[str, Any]) -> str:
    gpu = m.get("gpu") or m.get("device_name") or "no GPU"
    return (
        f"# GPU proof, {m.get('date', '?')}\n\n"
        f"Machine: {gpu}; CPU {m.get('cpu_model')} ({m.get('cpus')} cores); Python "
        f"{m.get('python')}, torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), transformers "
        f"{m.get('transformers')}, NIXL {m.get('nixl-cu13') or m.get('nixl-cu12') or m.get('nixl')}"
        f"; pdserve {m.get('git')}."
    )


def _steps(steps: Iterable[dict[str, Any]]) -> str:
    rows = [
        f"| {s['step']} | {s['status']} | {s['seconds']:.0f} | {s.get('note') or ''} |"
        for s in steps
    ]
    return "\n".join(["| step | status | seconds | note |", "|---|---|---|---|", *rows])


def _tests(cases: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    head = "## Tests (pytest tests/gpu)\n\n" + (
        ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ran"
    )
    lines = [
        f"- {c['outcome']}: `{c['test']}`: {c['message']}"
        for c in cases
        if c["outcome"] in ("failed", "error")
    ]
    reasons: dict[str, int] = {}
    for c in cases:
        if c["outcome"] == "skipped":
            reasons[c["message"]] = reasons.get(c["message"], 0) + 1
    lines += [f"- skipped ({n}): {why}" for why, n in reasons.items()]
    return "\n".join([head, "", *lines]) if lines else head


def _engine(results: list[dict[str, Any]]) -> str:
    if not results:
        return "## Engine\n\nno figures"
    by = {(r["dtype"], r["concurrency"], _graphs(r)): r for r in results}
    lines = [
        "## Engine (one process; TPOT = decode step at batch c)",
        "",
        f"Model {results[0]['model']} on {results[0]['device']}, "
        f"{results[0]['prompt_tokens']}-token prompts, {results[0]['max_tokens']} tokens each.",
        "",
        "| dtype | batch | TPOT p50 ms, graphs off | on | off / on | TTFT p50 ms off / on "
        "| decode tok/s on | prefill tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype, c in sorted({(d, c) for d, c, _ in by}, key=lambda k: (k[0], k[1])):
        off, on = by.get((dtype, c, False)), by.get((dtype, c, True))
        used = on is not None and on["cuda_graphs"]  # else the "on" engine ran eager
        ratio = off["tpot_ms_p50"] / on["tpot_ms_p50"] if off and on and used else None
        lines.append(
            f"| {dtype} | {c} | {_ms(off, 'tpot_ms_p50')} | {_ms(on, 'tpot_ms_p50')} | "
            f"{_x(ratio)} | {_ms(off, 'ttft_ms_p50', 1)} / {_ms(on, 'ttft_ms_p50', 1)} | "
            f"{_ms(on, 'decode_tokens_per_s', 0)} | "
            f"{_ms(on or off, 'prefill_tokens_per_s', 0)} |"
        )
    if any(_graphs(r) and not r["cuda_graphs"] for r in results):
        lines += [
            "",
            "CUDA graphs were asked for but not used (not a CUDA device): the graphs "
            "on column ran eager.",
        ]
    return "\n".join(lines)


def _graphs(r: dict[str, Any]) -> bool:
    """Whether a ``bench gpu engine`` result's engine was asked for CUDA graphs."""
    return bool(r.get("cuda_graphs_requested", r["cuda_graphs"]))


def _serve(rows: list[dict[str, Any]], args: dict[str, Any]) -> str:
    if not rows:
        return "## Stack\n\nno figures"
    lines = [
        "## Stack (pdserve bench serve: 1 prefill + 1 decode, then one colocated worker)",
        "",
        f"{args.get('input_len')}-token prompts, {args.get('output_len')} output tokens, "
        f"CUDA graphs {args.get('stack_cuda_graphs')}, dtype {args.get('dtype')}.",
        "",
        "| run | concurrency | requests | errors | TTFT p50 / p90 ms | ITL p50 / p90 ms "
        "| TPOT p50 ms | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
            f"{_ms(r, 'ttft_ms_p50', 1)} / {_ms(r, 'ttft_ms_p90', 1)} | "
            f"{_ms(r, 'itl_ms_p50')} / {_ms(r, 'itl_ms_p90')} | {_ms(r, 'tpot_ms_p50')} | "
            f"{_ms(r, 'output_tokens_per_s', 0)} |"
        )
    errors = [r for r in rows if r.get("first_error")]
    lines += [f"- {r['label']} c={r['concurrency']}: {r['first_error']}" for r in errors]
    return "\n".join(lines)


def _transfer(results: list[dict[str, Any]]) -> str:
    if not results:
        return "## KV transfer\n\nno figures"
    by = {(r["backend"], r["src"], r["dst"], r["blocks"], r["integrity"]): r for r in results}
    lines = [
        "## KV transfer (SmolLM2's float32 layout, 720 KiB per block; GB/s at the median)",
        "",
        "| backend | pools | blocks | MiB | GB/s digests off | on | on / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, s, d, n in sorted({k[:4] for k in by}):
        off, on = by.get((b, s, d, n, False)), by.get((b, s, d, n, True))
        share = on["gbps_p50"] / off["gbps_p50"] if on and off else None
        mib = (on or off or {}).get("mib", 0.0)
        lines.append(
            f"| {b} | {s} -> {d} | {n} | {mib:.1f} | {_ms(off, 'gbps_p50', 2)} | "
            f"{_ms(on, 'gbps_p50', 2)} | {_x(share)} |"
        )
    compiled = sorted({d for r in results for d in r.get("digest_compiled", [])})
    if any(r["src"].startswith("cuda") and r["dst"].startswith("cuda") for r in results):
        lines += [
            "",
            "Digests between GPU pools: mix64 on the GPU, "
            + (
                f"compiled kernel on {', '.join(compiled)}"
                if compiled
                else "eager (the compiled kernel was not in use)"
            )
            + ".",
        ]
    return "\n".join(lines)


def _verdicts(steps: dict[str, dict[str, Any]]) -> str:
    """Issue 29's targets: each met, missed (with the figure) or not measured."""
    lines = ["## Targets"]
    tests = steps.get("tests", {}).get("results", [])
    graph_cases = [c for c in tests if GRAPH_TESTS in c["test"]]
    if not graph_cases:
        lines.append("- CUDA graphs as the CUDA default: not decided (no graph test ran)")
    else:
        bad = [c for c in graph_cases if c["outcome"] in ("failed", "error")]
        skipped = [c for c in graph_cases if c["outcome"] == "skipped"]
        if bad:
            verdict = "no: " + "; ".join(f"`{c['test']}` {c['outcome']}" for c in bad)
        elif skipped:
            verdict = f"not decided: {len(skipped)} of {len(graph_cases)} graph tests skipped"
        else:
            verdict = f"yes: all {len(graph_cases)} graph tests passed"
        lines.append(f"- CUDA graphs as the CUDA default: {verdict}")
    engine = steps.get("engine", {}).get("results", [])
    solo = [r for r in engine if r["concurrency"] == 1 and r["cuda_graphs"]]  # graphs used
    for r in solo:
        met = "met" if r["tpot_ms_p50"] <= TPOT_TARGET_MS else "MISSED"
        lines.append(
            f"- decode step at batch 1 with CUDA graphs <= {TPOT_TARGET_MS:g} ms ({r['dtype']}): "
            f"{met}: {r['tpot_ms_p50']:.2f} ms"
        )
    if not solo:
        lines.append(f"- decode step at batch 1 <= {TPOT_TARGET_MS:g} ms: not measured")
    transfer = steps.get("transfer", {}).get("results", [])
    for backend in sorted({r["backend"] for r in transfer}):
        rows = [r for r in transfer if r["backend"] == backend]
        top = max(r["blocks"] for r in rows)
        pair = {r["integrity"]: r for r in rows if r["blocks"] == top}
        if True in pair and False in pair:
            share = pair[True]["gbps_p50"] / pair[False]["gbps_p50"]
            met = "met" if share >= DIGEST_TARGET else "MISSED"
            lines.append(
                f"- {backend} digests on >= {DIGEST_TARGET:g}x off at {top} blocks: {met}: "
                f"{share:.2f}x ({pair[True]['gbps_p50']:.2f} / {pair[False]['gbps_p50']:.2f} GB/s)"
            )
    return "\n".join(lines)


def _ms(r: dict[str, Any] | None, key: str, digits: int = 2) -> str:
    v = None if r is None else r.get(key)
    return "-" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
