"""The planner's profile model, its discrete-event simulation and its recommendation, on
profiles whose numbers make the expected times computable by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.planner.plan import Targets, candidates, evaluate, recommend
from pdserve.planner.profile import EngineProfile, Profile, ProfileError, interp
from pdserve.planner.simulate import Deployment, LengthDist, Simulation, Workload, simulate

# Prefill: 10 ms fixed + 0.1 ms a token; decode: 20 ms + 1 ms a sequence (context-free);
# a mixed step shares 8 ms. Hand-off: 1 ms + 1 ms per MiB. Router 1 ms, leg 2 ms.
ENGINE = EngineProfile(
    threads=1,
    prefill=[(100, 0.020), (1000, 0.110)],
    decode=[(1, 128, 0.021), (1, 1024, 0.021), (9, 128, 0.029), (9, 1024, 0.029)],
    mixed=[(100, 1, 128, 0.021 + 0.020 - 0.008)],
)
MIB = 2**20


def profile(**kw: object) -> Profile:
    args: dict[str, object] = {
        "model": "m", "engines": [ENGINE], "handoff": [(0, 0.001), (MIB, 0.002)],
        "kv_bytes_per_token": MIB // 16, "tokens_per_block": 16, "router_s": 0.001,
        "leg_s": 0.002,
    }  # fmt: skip
    args.update(kw)
    return Profile(**args)  # type: ignore[arg-type]


def one(prompt: int, output: int) -> Workload:
    return Workload(LengthDist(prompt, prompt), LengthDist(output, output), 1, concurrency=1)


def test_interp_extends_the_end_segments() -> None:
    assert interp([0, 10], [1, 2], 5) == 1.5
    assert interp([0, 10], [1, 2], 20) == 3.0
    assert interp([0, 10, 20], [0, 10, 30], -10) == -10
    assert interp([4], [7], 100) == 7


def test_step_times_follow_the_measured_points() -> None:
    e = ENGINE
    assert e.fixed_s == pytest.approx(0.010)
    assert e.prompt_s(500) == pytest.approx(0.060)
    assert e.chunk_s(100, 400) == pytest.approx(0.010 + 0.010)  # growth + the fixed cost
    assert e.decode_s(5, 300) == pytest.approx(0.025)
    assert e.decode_s(17, 128) == pytest.approx(0.037)  # extended in batch
    assert e.overlap_s == pytest.approx(0.008)
    assert e.step_s([(100, 0)], 1, 128) == pytest.approx(0.033)
    assert e.step_s([], 0, 0) == 0.0
    assert e.step_s([(100, 0), (100, 0)], 0, 0) == pytest.approx(0.030)  # one fixed cost


def test_one_disaggregated_request_by_hand() -> None:
    p = profile()
    sim = Simulation(p, Deployment(1, 1, local_prefill_max_tokens=0), one(160, 4), jitter=0)
    (r,) = sim.run()
    # router 1 ms + prefill of 160 tokens (26 ms) + leg 2 ms
    assert r.ttft == pytest.approx(0.001 + 0.026 + 0.002)
    # then a leg, the pull of 10 blocks (10 MiB: 11 ms) and a decode step of 1 (21 ms)
    assert r.itl[0] == pytest.approx(0.002 + 0.011 + 0.021 - 0.002)
    assert r.itl[1:] == pytest.approx([0.021, 0.021])
    assert len(r.token_s) == 4


def test_local_prefill_below_the_threshold_skips_the_hand_off() -> None:
    sim = Simulation(
        profile(), Deployment(1, 1, local_prefill_max_tokens=256), one(160, 3), jitter=0
    )
    (r,) = sim.run()
    assert r.ttft == pytest.approx(0.001 + 0.026)  # on the decode worker, no leg back
    assert r.itl == pytest.approx([0.021, 0.021])


def test_decode_batch_and_queueing_under_load() -> None:
    w = Workload(LengthDist(100, 100), LengthDist(50, 50), 9, concurrency=9)
    dep = Deployment(1, 1, max_num_batched_tokens=1024, local_prefill_max_tokens=0)
    out = simulate(profile(), dep, w, jitter=0)
    # nine prompts in one prefill step: one fixed cost, 900 tokens (10 + 90 ms)
    assert out["ttft_ms"]["p50"] == pytest.approx(1 + 100 + 2, abs=0.5)
    # all nine decode together: 29 ms steps
    assert out["itl_ms"]["p50"] == pytest.approx(29, abs=0.5)
    assert 0 < out["utilization"]["prefill"] < out["utilization"]["decode"] <= 1


def test_more_prefill_workers_cut_ttft_under_prompt_heavy_load() -> None:
    w = Workload(LengthDist(900, 1000), LengthDist(8, 8), 200, request_rate=15.0, seed=1)
    one_p = simulate(profile(), Deployment(1, 1, local_prefill_max_tokens=0), w)
    two_p = simulate(profile(), Deployment(2, 1, local_prefill_max_tokens=0), w)
    assert two_p["ttft_ms"]["p90"] < 0.5 * one_p["ttft_ms"]["p90"]
    assert one_p["utilization"]["prefill"] > 0.9


def test_workers_sharing_too_few_cores_slow_down_only_while_busy_together() -> None:
    dep = Deployment(0, 2, local_prefill_max_tokens=1000, cores=1)
    alone = simulate(
        profile(), dep, one(160, 6), jitter=0
    )  # one request: one worker busy at a time
    both = Workload(LengthDist(160, 160), LengthDist(6, 6), 2, concurrency=2)
    shared = simulate(
        profile(), dep, both, jitter=0
    )  # one on each worker, stepping at the same times
    assert alone["itl_ms"]["p50"] == pytest.approx(21)
    assert shared["itl_ms"]["p50"] == pytest.approx(42)
    assert shared["ttft_ms"]["p50"] == pytest.approx(1 + 2 * 26)
    wide = simulate(
        profile(), Deployment(0, 2, local_prefill_max_tokens=1000, cores=2), both, jitter=0
    )
    assert wide["itl_ms"]["p50"] == pytest.approx(21)


def test_jitter_spreads_step_times_reproducibly() -> None:
    """Steps vary by a few per cent around the profile (seeded by the workload's seed), so
    that a closed loop does not stay in lockstep; without jitter every step is exact."""
    dep = Deployment(1, 1, local_prefill_max_tokens=0)
    exact = simulate(profile(), dep, one(160, 40), jitter=0)
    noisy = simulate(profile(), dep, one(160, 40))
    assert exact["itl_ms"]["p90"] == pytest.approx(exact["itl_ms"]["p50"]) == pytest.approx(21)
    assert noisy["itl_ms"]["p90"] > noisy["itl_ms"]["p50"] * 1.02
    assert noisy["itl_ms"]["p50"] == pytest.approx(21, rel=0.05)
    assert simulate(profile(), dep, one(160, 40)) == noisy


def test_goodput_and_the_recommendation() -> None:
    w = Workload(LengthDist(900, 1000), LengthDist(16, 16), 150, request_rate=12.0, seed=2)
    targets = Targets(ttft_s=0.25, itl_s=0.05, attainment=0.9)
    deps = candidates([0, 1, 2, 3], [1, 2], [1024], [0], max_workers=4)
    assert all(d.workers <= 4 and d.decode >= 1 for d in deps)
    rows = evaluate(profile(), deps, w, targets)
    best, ok = recommend(rows, targets)
    assert ok and best["goodput"]["fraction"] >= 0.9
    fewer = [r for r in rows if r["workers"] < best["workers"]]
    assert fewer and all(r["goodput"]["fraction"] < 0.9 for r in fewer)
    impossible = Targets(ttft_s=0.0001, attainment=0.9)
    worst, ok = recommend(evaluate(profile(), deps[:2], w, impossible), impossible)
    assert not ok and worst["goodput"]["fraction"] == 0.0


def test_profile_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    profile(meta={"cpu": "test cpu"}).save(path)
    back = Profile.load(path)
    assert back.meta["cpu"] == "test cpu" and back.engine(4).threads == 1
    assert back.handoff_s(160) == pytest.approx(0.011)
    for bad, message in (({"format": "x"}, "not a pdserve profile"),
                         ({**json.loads(path.read_text()), "engines": [{"threads": 1}]}, "malformed")):  # fmt: skip
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=message):
            Profile.load(path)
    with pytest.raises(ProfileError, match="not JSON"):
        path.write_text("{")
        Profile.load(path)
    with pytest.raises(ProfileError, match="empty"):
        EngineProfile(1, [], [(1, 1, 0.1)])
    with pytest.raises(ValueError, match="LOW:HIGH"):
        LengthDist.parse("9:3")
    assert LengthDist.parse("5:9") == LengthDist(5, 9) and str(LengthDist(4, 4)) == "4"


def test_plan_command_prints_the_table_and_the_choice(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = tmp_path / "p.json"
    profile().save(path)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--profile", str(path), "--input-len", "900:1000", "--output-len", "16",
               "--request-rate", "12", "--num-requests", "100", "--ttft-slo-ms", "250",
               "--itl-slo-ms", "50", "--prefill", "0:2", "--decode", "1,2", "--chunk", "1024",
               "--local-prefill-max-tokens", "0", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0 and "recommended:" in text and "meets the 90 % attainment target" in text
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 6 and report["meets_target"] is True
    assert report["recommended"] in text
    assert main(["plan", "--profile", str(tmp_path / "missing.json")]) == 2
    assert "plan:" in capsys.readouterr().err


def test_the_documented_plan_runs_on_the_recorded_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/planning.md's `pdserve plan` example, as written, on the profile it names (a real
    `pdserve bench profile` of SmolLM2 on the 2-core AMD EPYC)."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "planning.md").read_text()
    block = re.search(r"## 3\. Plan\n\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/planning.md: the plan example is gone"
    argv = shlex.split(block[1].replace("\\\n", " "))
    assert argv[:2] == ["pdserve", "plan"]
    profile_arg = argv[argv.index("--profile") + 1]
    argv[argv.index("--profile") + 1] = str(root / profile_arg)
    rc = main(argv[1:])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "recommended:" in out
    assert out.count("P+") >= 6  # every candidate has a row
    p = Profile.load(root / profile_arg)
    assert p.meta["tool"] == "pdserve bench profile" and len(p.engines) >= 1


def test_the_simulation_matches_the_recorded_real_runs() -> None:
    """docs/bench/plan-check-measured.json holds real runs of three P:D splits x three
    workloads on the 2-core AMD EPYC (`pdserve bench plan-check`); the simulation with the
    profile recorded there must stay as close as docs/benchmarks.md reports: TTFT and ITL p50
    within 25 % for all but one of the 18 figures, and that one within 35 %."""
    root = Path(__file__).resolve().parents[2]
    profile = Profile.load(root / "docs" / "bench" / "profile-smollm2-amd-epyc-2c.json")
    report = json.loads((root / "docs" / "bench" / "plan-check-measured.json").read_text())
    errors = []
    for row in report["rows"]:
        inp, out = (int(x) for x in row["workload"].split(":"))
        workload = Workload(LengthDist(inp, inp), LengthDist(out, out), row["num_requests"],
                            concurrency=row["concurrency"])  # fmt: skip
        pred = simulate(profile, Deployment(**row["deployment"]), workload)
        for key in ("ttft_ms", "itl_ms"):
            real = row["measured"][key]["p50"]
            errors.append(
                (abs(pred[key]["p50"] - real) / real, row["config"], row["workload"], key)
            )
    assert len(errors) == 18
    far = sorted(errors, reverse=True)
    assert far[1][0] <= 0.25 and far[0][0] <= 0.35, far[:3]
