"""KV-aware routing (router/policy.py's cost, Router.route with the KV index): the worker
holding the prompt's prefix wins unless its load outweighs the saved prefill; weight 0 is
least-loaded routing; the decode worker's cached prefix feeds local prefill; decisions are
logged with every candidate's score and observed in the overlap histogram."""

from __future__ import annotations

import logging

import httpx
import pytest

from pdserve.block_hash import BlockHasher
from pdserve.config.settings import RouterSettings
from pdserve.discovery.kvcache import KVCacheEvent, encode_hash
from pdserve.protocol import SamplingParams, WorkerLoad
from pdserve.router.client import WorkerClient
from pdserve.router.kv_index import KVIndex
from pdserve.router.policy import (
    LEAST_LOADED,
    RoutePath,
    RouteWeights,
    choose_retry,
    choose_route,
    route_cost,
)
from pdserve.router.router import Router
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.view import WorkerView
from tests.support.fakes import CLUSTER_KEY, MODEL, FakeWatcher, FakeWorker, layout, record

KV = RouteWeights(kv_overlap_weight=1.0, load_weight=256.0)
PROMPT_TOKENS = 1000


def candidates(*records):  # type: ignore[no-untyped-def]
    return WorkerView(FakeWatcher(list(records)), served_model_name=MODEL).candidates()


def test_the_prefill_worker_holding_the_prefix_wins_over_a_less_loaded_one() -> None:
    cands = candidates(
        record("p0", "prefill"),
        record("p1", "prefill", load=WorkerLoad(running=2)),
        record("d0", "decode"),
    )
    cached = {"p1": 960}
    route = choose_route(
        cands, PROMPT_TOKENS, local_prefill_max_tokens=0, cached=cached, weights=KV
    )
    assert route.prefill is not None and route.prefill.worker_id == "p1"
    assert route.prefill_cached_tokens == 960
    p0, p1 = cands.prefill
    assert route_cost(p1, PROMPT_TOKENS, 960, KV) < route_cost(p0, PROMPT_TOKENS, 0, KV)
    scores = {s.worker_id: s for s in route.scores}
    assert (scores["p1"].cached_tokens, scores["p1"].load) == (960, 2)
    assert scores["p1"].cost == route_cost(p1, PROMPT_TOKENS, 960, KV)


def test_load_outweighs_the_prefix_past_the_saved_tokens() -> None:
    """960 saved tokens at 256 per request: 4 more requests (1024) make the other worker
    cheaper."""
    cands = candidates(
        record("p0", "prefill"),
        record("p1", "prefill", load=WorkerLoad(running=4)),
        record("d0", "decode"),
    )
    route = choose_route(
        cands, PROMPT_TOKENS, local_prefill_max_tokens=0, cached={"p1": 960}, weights=KV
    )
    assert route.prefill is not None and route.prefill.worker_id == "p0"


def test_weight_zero_is_least_loaded_routing() -> None:
    cands = candidates(
        record("p0", "prefill"),
        record("p1", "prefill", load=WorkerLoad(running=1)),
        record("d0", "decode"),
    )
    for weights in (LEAST_LOADED, RouteWeights(kv_overlap_weight=0.0)):
        route = choose_route(
            cands, PROMPT_TOKENS, local_prefill_max_tokens=0, cached={"p1": 960}, weights=weights
        )
        assert route.prefill is not None and route.prefill.worker_id == "p0"
        assert (route.prefill_cached_tokens, route.scores) == (0, ())


def test_equal_costs_fall_back_to_the_least_loaded_order() -> None:
    cands = candidates(
        record("p1", "prefill"),
        record("p0", "prefill"),
        record("d0", "decode"),
    )
    cached = {"p0": 512, "p1": 512}
    route = choose_route(
        cands, PROMPT_TOKENS, local_prefill_max_tokens=0, cached=cached, weights=KV
    )
    assert route.prefill is not None and route.prefill.worker_id == "p0"  # the id tie-break


def test_the_decode_worker_holding_the_prefix_is_chosen_and_drives_local_prefill() -> None:
    cands = candidates(record("p0", "prefill"), record("d0", "decode"), record("d1", "decode"))
    route = choose_route(cands, 300, local_prefill_max_tokens=256, cached={"d1": 64}, weights=KV)
    assert (route.path, route.worker.worker_id, route.cached_tokens) == (
        RoutePath.LOCAL_PREFILL,
        "d1",
        64,
    )
    assert "236 tokens to compute <= local_prefill_max_tokens 256" in route.reason
    far = choose_route(cands, 400, local_prefill_max_tokens=256, cached={"d1": 64}, weights=KV)
    assert far.path == RoutePath.DISAGGREGATED and far.worker.worker_id == "d1"


# -- the router, with its index ---------------------------------------------------------------


TPB = 16
PROMPT = list(range(1, 1 + 10 * TPB + 5))


def holding(index: KVIndex, worker_id: str, tokens: list[int]) -> None:
    """Feed ``index`` a snapshot in which ``worker_id`` holds ``tokens``' full blocks."""
    lay = layout(tokens_per_block=TPB)
    hashes = BlockHasher(lay.model, lay.dtype, TPB).hash_tokens(tokens)
    index.apply(
        CLUSTER_KEY.sign_event(KVCacheEvent(
            worker_id=worker_id, epoch=7, seq=0, sent_at=0.0, reset=True,
            stored=tuple(encode_hash(h) for h in hashes),
        ))
    )  # fmt: skip


@pytest.mark.parametrize("weight", [1.0, 0.0])
async def test_the_router_sends_the_prompt_to_the_worker_holding_it(
    weight: float, caplog: pytest.LogCaptureFixture
) -> None:
    reply = [(72, "H"), (105, "i"), (10, "\n")]
    workers = [FakeWorker(w, role, reply) for w, role in
               (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))]  # fmt: skip
    index = KVIndex(key=CLUSTER_KEY)
    holding(index, "p1", PROMPT)
    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in workers}
    metrics = RouterMetrics(kv_index=index.stats)
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as http:
        router = Router(
            WorkerView(FakeWatcher([w.record() for w in workers]), served_model_name=MODEL),
            WorkerClient(http, key=CLUSTER_KEY, connect_timeout_s=1.0),
            RouterSettings(
                request_timeout_s=10.0, local_prefill_max_tokens=0, kv_overlap_weight=weight
            ),
            metrics=metrics,
            kv_index=index,
        )
        with caplog.at_level(logging.DEBUG, logger="pdserve.router.router"):
            txn = await router.start("r1", PROMPT, SamplingParams(max_tokens=3))
            [e async for e in txn.events()]
    chosen = "p1" if weight else "p0"
    assert [len(w.contexts) for w in workers[:2]] == ([0, 1] if weight else [1, 0])
    text = metrics.render().decode()
    sample = 'pdserve_router_kv_overlap_tokens_sum{path="disaggregated",role="prefill"}'
    if weight:
        held = (len(PROMPT) - 1) // TPB * TPB  # every full block before the last token
        assert f"{sample} {float(held)}" in text
        n = len(PROMPT)
        assert (
            f"KV-aware: p0(cached=0 load=0 cost={n}) p1(cached={held} load=0 cost={n - held})"
            in caplog.text
        )
    else:
        assert sample not in text and "KV-aware" not in caplog.text
    assert f"after prefill on {chosen}" in caplog.text
    assert 'pdserve_router_kv_events_total{outcome="applied"} 1.0' in text  # the snapshot
    assert "pdserve_router_kv_index_blocks 10.0" in text


def test_retries_and_migrations_take_the_first_routes_order() -> None:
    """policy.choose_retry, used by a refused decode leg's retry and by a migration: the KV-aware
    cost when on (the decode worker holding the prefix beats a less loaded one), least-loaded
    otherwise; ``skip`` leaves out what was tried, ``maps_from`` what P's layout cannot reach,
    and colocated workers count only for a migration."""
    cands = candidates(
        record("d0", "decode"),
        record("d1", "decode", load=WorkerLoad(running=2)),
        record("d2", "decode", kv_layout=layout(num_kv_heads=4)),
        record("c0", "colocated"),
    )
    cached = {"d1": 960}

    def pick(**kw):  # type: ignore[no-untyped-def]
        kw.setdefault("skip", lambda w: False)
        target = choose_retry(cands, PROMPT_TOKENS, cached=cached, **kw)
        return target.worker_id if target is not None else None

    assert pick(weights=KV) == "d1"
    assert pick(weights=LEAST_LOADED) == "d0"
    assert pick(weights=KV, skip=lambda w: w.worker_id == "d1") == "d0"
    assert pick(skip=lambda w: w.worker_id in ("d0", "d1")) == "d2"
    assert pick(skip=lambda w: w.worker_id in ("d0", "d1"), maps_from=layout()) is None
    assert pick(skip=lambda w: w.worker_id != "c0") is None
    assert pick(skip=lambda w: w.worker_id != "c0", colocated=True) == "c0"
