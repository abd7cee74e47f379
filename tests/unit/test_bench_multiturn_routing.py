"""``pdserve bench multiturn --compare routing``: the two arms, distinct system
prompts per conversation, and the KV-aware / least-loaded ratios."""

from __future__ import annotations

from pdserve.bench.serving import bench_multiturn as bm


def test_the_routing_arms_differ_only_in_the_kv_overlap_weight() -> None:
    kv, ll = bm.routing_arms(3)
    assert (kv.prefill_workers, ll.prefill_workers) == (3, 3)
    assert kv.prefix_caching and ll.prefix_caching
    assert kv.router_args == ("--router-kv-overlap-weight", "1")
    assert ll.router_args == ("--router-kv-overlap-weight", "0")


def test_distinct_system_prompts_share_no_leading_text() -> None:
    wl = bm.make_workload(4, 2, 200, seed=0, distinct=True)
    systems = [wl.system_of(c) for c in range(4)]
    assert len(set(systems)) == 4
    # After the common opening line, each prompt starts with a different rule.
    rules = [s.split("Rule 1: ", 1)[1][:30] for s in systems]
    assert len(set(rules)) == 4
    shared = bm.make_workload(4, 2, 200, seed=0)
    assert {shared.system_of(c) for c in range(4)} == {shared.system}


def test_routing_ratios_compare_kv_aware_with_least_loaded() -> None:
    def arm(hit: float, p50: float) -> dict[str, object]:
        pct = {"p50": p50, "p90": 2 * p50}
        return {"hit_rate": hit, "ttft_all_ms": pct, "ttft_later_ms": pct}

    ratios = bm.routing_ratios([arm(0.8, 50.0), arm(0.4, 100.0)])
    assert ratios[f"hit rate kv-aware / least-load (target >= {bm.TARGET_HIT_RATIO}x)"] == 2.0
    assert ratios["TTFT p50 all turns kv-aware / least-load (target < 1x)"] == 0.5
    assert ratios["TTFT p90 turns 2+ kv-aware / least-load"] == 0.5
    assert bm.routing_ratios([arm(0.8, 50.0)]) == {}
    table = bm.format_table(
        [
            {
                **arm(0.8, 50.0),
                "label": "kv-aware",
                "ttft_turn1_ms": {"p50": 1.0, "p90": 2.0},
                "prompt_tokens": 10,
                "prefill_computed_tokens": 2.0,
            },
            {
                **arm(0.4, 100.0),
                "label": "least-load",
                "ttft_turn1_ms": {"p50": 1.0, "p90": 2.0},
                "prompt_tokens": 10,
                "prefill_computed_tokens": 6.0,
            },
        ],  # fmt: skip
        "routing",
    )
    assert "hit rate kv-aware / least-load (target >= 2.0x): 2.00x" in table
