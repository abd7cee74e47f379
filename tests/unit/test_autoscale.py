"""The autoscaling planner on a fake metrics source: what it reads of the router's metrics
(rendered by the router's own RouterMetrics, so the names are the ones exported), its
decisions (prediction, reaction, hysteresis), and the loop that logs, exports and acts."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client import generate_latest

from pdserve.config.planner_settings import PlannerSettings
from pdserve.config.settings import PdserveConfig
from pdserve.planner.autoscale import AutoscaleLoop, Planner, router_metrics_fetcher
from pdserve.planner.local import autoscale_settings
from pdserve.planner.observe import (
    Observation,
    histogram_quantile,
    merge_snapshots,
    observe,
    parse_metrics,
)
from pdserve.planner.profile import EngineProfile, Profile
from pdserve.router.router_metrics import RouterMetrics
from tests.support.servers import free_port


def obs(rate: float = 1.0, ttft: float | None = 0.1, itl: float | None = 0.02, prompt: float = 900,
        output: float = 16, running: float = 1.0, finished: float = 10) -> Observation:  # fmt: skip
    return Observation(10.0, rate, prompt, output, ttft, itl, running, {}, finished)


SETTINGS = PlannerSettings(min_prefill=0, max_prefill=2, min_decode=1, max_decode=3,
                           ttft_slo_ms=250, itl_slo_ms=50, scale_down_intervals=2,
                           cooldown_s=0)  # fmt: skip
# 10 ms + 0.1 ms a prompt token; decode 20 ms + 1 ms a sequence; cheap hand-offs
PROFILE = Profile(
    "m",
    [
        EngineProfile(1, [(100, 0.020), (1000, 0.110)], [(1, 128, 0.021), (9, 128, 0.029)])
    ],  # fmt: skip
    handoff=[(0, 0.001), (2**20, 0.002)],
    kv_bytes_per_token=2**16,
)


def test_router_metrics_become_an_observation() -> None:
    m = RouterMetrics(workers=lambda: {"prefill": 1, "decode": 2})
    before = parse_metrics(generate_latest(m.registry).decode(), at=0.0)
    for i in range(10):
        m.requests.labels(outcome="finished" if i else "failed").inc()
        m.ttft.observe(0.5 if i == 9 else 0.03)
        for _ in range(5):
            m.itl.observe(0.02)
    m.prompt_tokens.inc(1200)  # 12 requests arrived (10 done, 2 running): 100 tokens each
    m.generation_tokens.inc(600)  # and 50 generated each, as flow rates
    m.running.set(2)
    after = parse_metrics(generate_latest(m.registry).decode(), at=10.0)
    o = observe(before, after)
    assert o.window_s == 10.0 and o.request_rate == pytest.approx(1.2)  # 10 done + 2 running
    assert (o.mean_prompt, o.mean_output, o.running) == (100, 50, 2)
    assert o.workers == {"prefill": 1, "decode": 2}
    assert o.ttft_p90 is not None and 0.025 <= o.ttft_p90 <= 0.05  # the 9th of 10 is fast
    assert o.itl_p90 is not None and 0.01 <= o.itl_p90 <= 0.025
    again = observe(after, parse_metrics(generate_latest(m.registry).decode(), at=20.0))
    assert again.request_rate == 0 and again.mean_prompt is None and again.ttft_p90 is None


def test_histogram_quantile_interpolates_in_the_bucket() -> None:
    inf = float("inf")
    after = {0.1: 50.0, 0.2: 90.0, 0.4: 100.0, inf: 100.0}
    assert histogram_quantile(0.5, {}, after) == pytest.approx(0.1)
    assert histogram_quantile(0.7, {}, after) == pytest.approx(0.15)
    assert histogram_quantile(0.95, {}, after) == pytest.approx(0.3)
    assert histogram_quantile(0.9, after, after) is None  # nothing observed in between
    assert histogram_quantile(0.99, {}, {0.1: 1.0, inf: 10.0}) == 0.1  # +Inf: its lower bound


def test_observed_misses_add_workers_at_once() -> None:
    p = Planner(SETTINGS)  # no profile: reaction only
    now = {"prefill": 1, "decode": 1}
    d = p.decide(obs(itl=0.09), now)
    assert d.target == {"prefill": 1, "decode": 2} and "ITL p90 90 ms > SLO 50 ms" in d.line(now)
    assert p.decide(obs(ttft=0.4), now).target == {"prefill": 2, "decode": 1}
    # prefill at its maximum: a TTFT miss adds a decode worker instead
    assert p.decide(obs(ttft=0.4), {"prefill": 2, "decode": 1}).target == {
        "prefill": 2,
        "decode": 2,
    }
    # and nothing passes the bounds
    assert p.decide(obs(itl=0.09), {"prefill": 2, "decode": 3}).target == {
        "prefill": 2,
        "decode": 3,
    }


def test_too_few_requests_for_a_p90_add_nothing_and_a_change_cools_down() -> None:
    p = Planner(SETTINGS)
    now = {"prefill": 1, "decode": 1}
    assert p.decide(obs(itl=0.09, finished=2), now).target == now  # two requests: no p90
    slow = Planner(SETTINGS.model_copy(update={"cooldown_s": 25, "interval_s": 10}))
    assert slow.decide(obs(itl=0.09), now).target == {"prefill": 1, "decode": 2}
    after = {"prefill": 1, "decode": 2}
    held = [slow.decide(obs(itl=0.09), after) for _ in range(3)]  # ceil(25 / 10) windows
    assert [d.target for d in held[:3]] == [after, after, after]
    assert "cooling down after a change (3 window(s) left)" in held[0].line(after)
    assert slow.decide(obs(itl=0.09), after).target == {"prefill": 1, "decode": 3}


def test_fewer_workers_only_after_the_intervals_in_a_row_and_one_at_a_time() -> None:
    p = Planner(SETTINGS)
    now = {"prefill": 2, "decode": 3}
    idle = obs(rate=0, running=0, ttft=None, itl=None)
    first = p.decide(idle, now)
    assert first.target == now and "1 of 2 intervals" in first.line(now)
    assert p.decide(obs(itl=0.09), now).target == now  # a busy window resets the count
    assert p.decide(idle, now).target == now
    second = p.decide(idle, now)
    assert second.target == {"prefill": 2, "decode": 2}  # one decode worker first
    assert "draining one decode worker" in second.line(now)
    # calm (both p90s under half their SLOs) without a profile: one fewer, after the wait
    p2 = Planner(SETTINGS)
    calm = obs(ttft=0.05, itl=0.01)
    assert p2.decide(calm, now).target == now
    assert p2.decide(calm, now).target == {"prefill": 2, "decode": 2}


def test_the_prediction_picks_the_fewest_workers_meeting_the_slos() -> None:
    p = Planner(SETTINGS, PROFILE, chunk=1024, local_prefill_max_tokens=0, sim_requests=150)
    busy = p.decide(obs(rate=12.0, ttft=0.1, itl=0.02), {"prefill": 1, "decode": 1})
    assert busy.predicted is not None and busy.predicted["goodput"]["fraction"] >= 0.9
    assert busy.target["prefill"] >= 2  # 12 req/s of 900-token prompts need a second one
    assert "predicted" in busy.reasons[0]
    light = Planner(SETTINGS, PROFILE, chunk=1024, local_prefill_max_tokens=0)
    d = light.decide(obs(rate=0.5), {"prefill": 2, "decode": 3})
    assert d.target == {"prefill": 2, "decode": 3}  # fewer asked for: waits first
    assert light.decide(obs(rate=0.5), {"prefill": 2, "decode": 3}).target["decode"] == 2


def test_the_loop_skips_failed_reads_logs_exports_and_acts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = RouterMetrics(workers=lambda: {"prefill": 1, "decode": 1})
    texts: list[str | Exception] = [generate_latest(m.registry).decode(), OSError("refused")]
    acted: list[dict[str, int]] = []

    def fetch() -> list[str]:
        item = texts.pop(0)
        if isinstance(item, Exception):
            raise item
        return [item]

    loop = AutoscaleLoop(
        Planner(SETTINGS), fetch, lambda: {"prefill": 1, "decode": 1}, acted.append
    )
    caplog.set_level(logging.INFO, logger="pdserve.planner")
    assert loop.step() is None  # the first sample
    assert loop.step() is None and "cannot read the router's metrics: OSError" in caplog.text
    for _ in range(6):  # enough finished requests for a p90 (MIN_REACTION_REQUESTS)
        m.requests.labels(outcome="finished").inc()
        m.itl.observe(0.3)
    m.running.set(1)
    texts.append(generate_latest(m.registry).decode())
    d = loop.step()
    assert d is not None and d.target == {"prefill": 1, "decode": 2} and acted == [d.target]
    assert "planner: scale 1P+1D -> 1P+2D" in caplog.text
    text = generate_latest(loop.metrics.registry).decode()
    assert 'pdserve_planner_desired_workers{role="decode"} 2.0' in text
    assert 'pdserve_planner_decisions_total{direction="up",role="decode"} 1.0' in text


def test_up_sizes_for_the_maximum_and_starts_within_the_bounds() -> None:
    cfg = PdserveConfig.model_validate({
        "prefill": {"replicas": 3}, "decode": {"replicas": 1},
        "planner": {"autoscale": True, "min_prefill": 0, "max_prefill": 2, "min_decode": 2,
                    "max_decode": 4},
    })  # fmt: skip
    sized, initial = autoscale_settings(cfg)
    assert (sized.prefill.replicas, sized.decode.replicas) == (2, 4)
    assert initial == {"prefill": 2, "decode": 2}
    with pytest.raises(ValueError, match="min_decode 3 <= max_decode 2"):
        PlannerSettings(min_decode=3, max_decode=2)


def test_the_routers_of_a_deployment_are_summed() -> None:
    a, b = (
        RouterMetrics(workers=lambda: {"decode": 2}),
        RouterMetrics(workers=lambda: {"decode": 1}),
    )
    before = merge_snapshots(
        [parse_metrics(generate_latest(m.registry).decode(), at=0.0) for m in (a, b)]
    )
    a.requests.labels(outcome="finished").inc(3)
    b.requests.labels(outcome="finished").inc(5)
    a.itl.observe(0.02)
    b.itl.observe(0.02)
    b.running.set(2)
    after = merge_snapshots(
        [parse_metrics(generate_latest(m.registry).decode(), at=4.0) for m in (a, b)]
    )
    o = observe(before, after)
    assert o.request_rate == pytest.approx((8 + 2) / 4) and o.running == 2
    assert o.workers == {"decode": 2}  # the most any router sees, not a sum
    with pytest.raises(ValueError, match="no router"):
        merge_snapshots([])


def test_the_fetcher_reads_a_real_metrics_endpoint() -> None:
    from prometheus_client import start_http_server

    m = RouterMetrics(workers=lambda: {"prefill": 1, "decode": 1})
    m.requests.labels(outcome="finished").inc(7)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    try:
        (text,) = router_metrics_fetcher(f"http://127.0.0.1:{port}")()
        assert parse_metrics(text).finished == 7
        with pytest.raises(httpx.HTTPError):
            router_metrics_fetcher(f"http://127.0.0.1:{free_port()}", timeout_s=2)()
    finally:
        server.shutdown()
        thread.join(5)


def test_requests_in_flight_count_when_an_overload_slows_a_closed_loop_down() -> None:
    """Clients that wait for each answer arrive slowly when the deployment is overloaded: the
    planner also reads the requests in flight as a closed loop and keeps the larger answer."""
    now = {"prefill": 0, "decode": 1}
    by_rate = Planner(SETTINGS, PROFILE, chunk=1024, local_prefill_max_tokens=0)
    quiet = by_rate.decide(obs(rate=0.5, running=0.4), now)
    assert quiet.target == now and "0.50 req/s" in quiet.reasons[0]
    crowded = Planner(SETTINGS, PROFILE, chunk=1024, local_prefill_max_tokens=0)
    d = crowded.decide(obs(rate=0.5, running=12), now)
    assert "12 in flight" in d.reasons[0]
    assert sum(d.target.values()) > sum(quiet.target.values())
