"""``pdserve bench multiturn``: the workload generator (deterministic for a seed,
each turn's prompt extends the previous one), the metrics parser and the table's ratio."""

from __future__ import annotations

from pdserve.bench.scrape import delta, parse_metrics
from pdserve.bench.serving import bench_multiturn as bm


def test_the_workload_is_deterministic_for_a_seed() -> None:
    a = bm.make_workload(5, 4, 300, seed=7)
    assert a == bm.make_workload(5, 4, 300, seed=7)
    assert a != bm.make_workload(5, 4, 300, seed=8)
    assert len(a.users) == 5 and all(len(u) == 4 for u in a.users)
    assert len({u[0] for u in a.users}) > 1  # conversations differ
    n = bm.approx_tokens(a.system)
    assert 300 <= n < 330
    for conv in a.users:
        assert all(12 <= bm.approx_tokens(m) <= 60 for m in conv)  # a few dozen tokens


def test_each_turn_extends_the_previous_one() -> None:
    wl = bm.make_workload(3, 5, 200, seed=1)
    for users in wl.users:
        replies: list[str] = []
        prev = bm.turn_messages(wl.system, users, replies)
        assert prev == [
            {"role": "system", "content": wl.system},
            {"role": "user", "content": users[0]},
        ]
        for t in range(1, len(users)):
            replies.append(f"reply {t}")
            cur = bm.turn_messages(wl.system, users, replies)
            assert cur[: len(prev)] == prev
            assert cur[len(prev) :] == [
                {"role": "assistant", "content": f"reply {t}"},
                {"role": "user", "content": users[t]},
            ]
            prev = cur


def test_a_warm_up_prompt_shares_no_prefix_with_the_system_prompt() -> None:
    system = bm.system_prompt(500)
    warm = bm.system_prompt(500, start=6)
    assert system != warm and system[:20] != warm[:20]


def test_metrics_deltas_and_the_table() -> None:
    text = (
        "# TYPE pdserve_prefix_cache_query_tokens counter\n"
        "pdserve_prefix_cache_query_tokens_total 1000.0\n"
        '# TYPE pdserve_router_decisions counter\npdserve_router_decisions_total{path="disaggregated"} 4.0\n'
    )
    m = parse_metrics(text)
    assert m["pdserve_prefix_cache_query_tokens_total"] == 1000.0
    assert m['pdserve_router_decisions_total{path="disaggregated"}'] == 4.0
    assert bm.parse_metrics is parse_metrics  # one reading of /metrics for every benchmark
    later = {**m, "pdserve_prefix_cache_query_tokens_total": 1500.0, "pdserve_new_total": 2.0}
    assert delta(m, later) == {
        "pdserve_prefix_cache_query_tokens_total": 500.0,
        'pdserve_router_decisions_total{path="disaggregated"}': 0.0,
        "pdserve_new_total": 2.0,
    }
    arm = {"ttft_turn1_ms": {"p50": 100.0, "p90": 120.0}, "prompt_tokens": 10,
           "prefill_computed_tokens": 5.0, "hit_rate": 0.5}  # fmt: skip
    on = {**arm, "label": "cache on", "ttft_later_ms": {"p50": 20.0, "p90": 30.0}}
    off = {**arm, "label": "cache off", "ttft_later_ms": {"p50": 100.0, "p90": 130.0}}
    assert bm.ratio([on, off]) == 0.2
    assert "0.20x (target <= 0.3x: met)" in bm.format_table([on, off])
