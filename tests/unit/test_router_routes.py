"""Conditional disaggregation and aggregated mode: the routing decision (``prefill_locally``,
``choose_route``) and the one-leg transactions it leads to, against scripted workers."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import httpx
import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.errors import CapacityError, NoWorkerError, WorkerError
from pdserve.protocol import FinishReason, Role, SamplingParams, WorkerLoad
from pdserve.router.client import WorkerClient
from pdserve.router.policy import RoutePath, choose_route, prefill_locally
from pdserve.router.router import Router
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.view import WorkerView
from tests.support.fakes import (
    CLUSTER_KEY,
    MODEL,
    SECURITY,
    FakeWatcher,
    FakeWorker,
    build_tokenizer_dir,
    layout,
    record,
    router_harness,
)

REPLY = [(72, "H"), (105, "i"), (33, "!"), (10, "\n")]
SHORT = [1, 2, 3]
LONG = list(range(1, 41))
THRESHOLD = 8


def worker(worker_id: str, role: Role, **kw) -> FakeWorker:
    return FakeWorker(worker_id, role, kw.pop("reply", REPLY), **kw)


@asynccontextmanager
async def make_router(*workers: FakeWorker, threshold: int = THRESHOLD, extra_records=()):
    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in workers}
    watcher = FakeWatcher([w.record() for w in workers] + list(extra_records))
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as http:
        view = WorkerView(watcher, served_model_name=MODEL)
        client = WorkerClient(http, key=CLUSTER_KEY, connect_timeout_s=1.0)
        yield Router(
            view,
            client,
            RouterSettings(
                request_timeout_s=10.0, local_prefill_max_tokens=threshold, worker_wait_s=0.0
            ),
            metrics=RouterMetrics(),
        )


async def run(router: Router, prompt: list[int], request_id: str = "r1", **sampling):
    txn = await router.start(request_id, prompt, SamplingParams(**sampling))
    return txn, [e async for e in txn.events()]


def decisions(router: Router) -> dict[str, float]:
    assert router.metrics is not None
    text = router.metrics.render().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_decisions_total{"):
            key, _, value = line.rpartition(" ")
            out[key.split('"')[1]] = float(value)
    return out


# -- the decision function -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "cached", "threshold", "local"),
    [
        (8, 0, 8, True),  # at the threshold: local
        (9, 0, 8, False),  # one above: through a prefill worker
        (1, 0, 8, True),
        (1, 0, 0, False),  # 0 turns it off, however short the prompt
        (300, 0, 0, False),
        (300, 100, 256, True),  # 200 left to compute after the cached prefix
        (300, 43, 256, False),  # 257 left
        (10, 10, 1, True),  # everything cached (the engine still computes one token)
        (10, 99, 4, True),  # an overestimated prefix cannot go below zero
    ],
)
def test_prefill_locally_compares_the_tokens_left_to_compute(prompt, cached, threshold, local):
    assert prefill_locally(prompt, cached, threshold) is local


def view_of(*records) -> WorkerView:
    return WorkerView(FakeWatcher(list(records)), served_model_name=MODEL)


def test_short_prompt_goes_to_the_least_loaded_decode_worker_alone():
    cands = view_of(
        record("p0", "prefill"),
        record("d0", "decode", load=WorkerLoad(running=3)),
        record("d1", "decode", load=WorkerLoad(running=1)),
    ).candidates()
    route = choose_route(cands, THRESHOLD, local_prefill_max_tokens=THRESHOLD)
    assert (route.path, route.worker.worker_id, route.prefill) == ("local_prefill", "d1", None)
    assert route.pair is None and "<= local_prefill_max_tokens 8" in route.reason

    long = choose_route(cands, THRESHOLD + 1, local_prefill_max_tokens=THRESHOLD)
    assert long.path == RoutePath.DISAGGREGATED
    assert long.pair is not None and (long.pair.prefill.worker_id, long.worker.worker_id) == (
        "p0",
        "d1",
    )
    off = choose_route(cands, 1, local_prefill_max_tokens=0)
    assert off.path == RoutePath.DISAGGREGATED and "off" in off.reason


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        ([record("d0", "decode")], "no usable prefill worker"),
        (
            [record("p0", "prefill", kv_layout=layout(num_kv_heads=4)), record("d0", "decode")],
            "no prefill/decode pair with mappable KV layouts",
        ),
    ],
)
def test_without_a_usable_pair_the_decode_worker_prefills_every_prompt(records, reason):
    route = choose_route(view_of(*records).candidates(), 10_000, local_prefill_max_tokens=0)
    assert (route.path, route.worker.worker_id, route.reason) == ("local_prefill", "d0", reason)


def test_excluded_prefill_workers_leave_local_prefill():
    cands = view_of(record("p0", "prefill"), record("d0", "decode")).candidates()
    route = choose_route(cands, 100, local_prefill_max_tokens=0, exclude={"p0"})
    assert route.path == RoutePath.LOCAL_PREFILL


def test_colocated_only_deployment_serves_every_prompt():
    cands = view_of(
        record("c0", "colocated", load=WorkerLoad(running=2)), record("c1", "colocated")
    ).candidates()
    for prompt in (1, 10_000):
        route = choose_route(cands, prompt, local_prefill_max_tokens=THRESHOLD)
        assert (route.path, route.worker.worker_id) == ("colocated", "c1")
    with pytest.raises(NoWorkerError, match="no live decode or colocated worker other than c0, c1"):
        choose_route(cands, 1, local_prefill_max_tokens=0, exclude={"c0", "c1"})


def test_both_kinds_the_less_loaded_side_wins_and_a_tie_goes_to_prefill_decode():
    p, d = record("p0", "prefill"), record("d0", "decode")
    view = view_of(p, d, record("c0", "colocated"))
    assert choose_route(view.candidates(), 100, local_prefill_max_tokens=0).path == (
        RoutePath.DISAGGREGATED
    )
    with view.track("d0"):  # one request in flight on the decode worker
        route = choose_route(view.candidates(), 100, local_prefill_max_tokens=0)
        assert (route.path, route.worker.worker_id) == ("colocated", "c0")
        assert "less loaded than decode worker d0" in route.reason
        with view.track("c0"), view.track("c0"):
            assert choose_route(view.candidates(), 1, local_prefill_max_tokens=8).path == (
                RoutePath.LOCAL_PREFILL
            )
    busy = view_of(p, record("d0", "decode", load=WorkerLoad(waiting=4)), record("c0", "colocated"))
    assert choose_route(busy.candidates(), 1, local_prefill_max_tokens=8).path == "colocated"


def test_no_decode_or_colocated_worker_is_a_503():
    with pytest.raises(NoWorkerError, match="no live decode or colocated worker") as err:
        choose_route(view_of(record("p0", "prefill")).candidates(), 1, local_prefill_max_tokens=8)
    assert err.value.status == 503


# -- one-leg transactions --------------------------------------------------------------------


async def test_short_prompt_is_served_by_the_decode_worker_alone(caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.router.router")
    p, d = worker("p0", Role.PREFILL), worker("d0", Role.DECODE)
    async with make_router(p, d) as router:
        txn, events = await run(router, SHORT)
        assert "req r1: route local_prefill via d0 (3 tokens to compute <= " in caplog.text
        assert txn.route.path == "local_prefill" and txn.pair is None
        assert [e.token_ids for e in events] == [(72,), (105,), (33,), (10,)]
        assert events[-1].finish_reason == FinishReason.STOP
        assert p.contexts == [] and p.releases == []
        (gen,) = d.generations
        assert gen.handle is None and gen.first_token is None
        assert gen.prompt_token_ids == tuple(SHORT)
        assert router.view.in_flight("d0") == 0

        txn, events = await run(router, LONG, request_id="r2")
        assert txn.route.path == "disaggregated" and txn.pair is not None
        assert "".join(e.text for e in events) == "Hi!\n"
        assert len(p.contexts) == 1 and d.generations[-1].handle is not None
        assert decisions(router) == {"disaggregated": 1, "local_prefill": 1, "colocated": 0}


async def test_no_prefill_worker_means_local_prefill_for_long_prompts_too():
    d = worker("d0", Role.DECODE)
    async with make_router(d, threshold=0) as router:
        txn, events = await run(router, LONG, max_tokens=2)
    assert txn.route.path == "local_prefill"
    assert [(e.text, e.finish_reason) for e in events] == [("H", None), ("i", "length")]
    assert decisions(router)["local_prefill"] == 1


async def test_colocated_worker_serves_the_request_and_it_is_measured():
    c = worker("c0", Role.COLOCATED)
    async with make_router(c) as router:
        txn, events = await run(router, LONG)
        assert txn.route.path == "colocated"
        assert "".join(e.text for e in events) == "Hi!\n"
        assert c.generations[0].handle is None
        text = router.metrics.render().decode()
    assert 'pdserve_requests_total{outcome="finished"} 1.0' in text
    assert "pdserve_time_to_first_token_seconds_count 1.0" in text
    assert "pdserve_generation_tokens_total 4.0" in text
    assert "pdserve_requests_running 0.0" in text
    assert decisions(router)["colocated"] == 1


async def test_one_token_request_finishes_in_start():
    c = worker("c0", Role.COLOCATED)
    async with make_router(c) as router:
        txn = await router.start("r1", SHORT, SamplingParams(max_tokens=1))
        assert txn.finished_at_start == FinishReason.LENGTH
        events = [e async for e in txn.events()]
    assert [(e.text, e.finish_reason) for e in events] == [("H", "length")]


async def test_one_leg_refusal_before_the_stream_is_typed_and_leaves_no_count():
    c = worker("c0", Role.COLOCATED, error=CapacityError("no free KV blocks"))
    async with make_router(c) as router:
        with pytest.raises(CapacityError, match="colocated worker c0") as err:
            await router.start("r1", SHORT, SamplingParams())
        assert err.value.status == 503
        assert router.view.in_flight("c0") == 0
        text = router.metrics.render().decode()
    assert 'pdserve_requests_total{outcome="failed"} 1.0' in text
    assert "pdserve_requests_running 0.0" in text


async def test_error_chunk_before_the_first_token_fails_start():
    d = worker("d0", Role.DECODE, fail_after=0)
    async with make_router(d) as router:
        with pytest.raises(WorkerError, match="decode worker d0 failed the request"):
            await router.start("r1", SHORT, SamplingParams())
        assert router.view.in_flight("d0") == 0


async def test_error_chunk_mid_stream_fails_the_transaction():
    d = worker("d0", Role.DECODE, fail_after=2)
    async with make_router(d) as router:
        txn = await router.start("r1", SHORT, SamplingParams())
        seen = []
        with pytest.raises(WorkerError, match="KV transfer from the prefill worker failed"):
            async for e in txn.events():
                seen.append(e.text)
        assert seen == ["H", "i"] and txn.state == "failed"
        assert router.view.in_flight("d0") == 0


async def test_unreachable_one_leg_worker_is_retried_on_another():
    dead = record("c-dead", "colocated", "http://127.0.0.1:1")  # nothing listens on port 1
    c = worker("c-ok", Role.COLOCATED, load=WorkerLoad(running=3))  # more loaded: tried second
    async with make_router(c, extra_records=[dead]) as router:
        txn, events = await run(router, SHORT)
    assert txn.route.worker.worker_id == "c-ok"
    assert "".join(e.text for e in events) == "Hi!\n"
    assert decisions(router)["colocated"] == 2  # decided again after the connection error


# -- through the OpenAI API ------------------------------------------------------------------


def _streamed_text(body: str) -> str:
    """The text of an SSE body (chat deltas or completion texts), checking it ends with DONE."""
    lines = [ln[len("data: ") :] for ln in body.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = ""
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=96)


@pytest.mark.parametrize("stream", [False, True])
async def test_colocated_worker_behind_the_router_serves_chat_and_completions(model_dir, stream):
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL, security=SECURITY)
    async with router_harness(cfg, [worker("c0", Role.COLOCATED)]) as h:
        assert (await h.client.get("/ready")).json()["paths"] == ["colocated"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream}
        completion = {"model": MODEL, "prompt": "hello", "stream": stream}
        texts = []
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            r = await h.client.post(path, json=body)
            assert r.status_code == 200, r.text
            if stream:
                texts.append(_streamed_text(r.text))
            else:
                choice = r.json()["choices"][0]
                texts.append(choice.get("text") or choice["message"]["content"])
        metrics = (await h.client.get("/metrics")).text
    assert texts == ["Hi!\n", "Hi!\n"]
    assert 'pdserve_router_decisions_total{path="colocated"} 2.0' in metrics
    assert 'pdserve_workers{role="colocated"} 1.0' in metrics


async def test_router_setting_turns_local_prefill_on_through_the_api(model_dir):
    cfg = RouterConfig(
        model_path=model_dir,
        served_model_name=MODEL,
        security=SECURITY,
        router=RouterSettings(local_prefill_max_tokens=64),
    )
    p, d = worker("p0", Role.PREFILL), worker("d0", Role.DECODE)
    async with router_harness(cfg, [p, d]) as h:
        r = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "hello"})
        assert r.json()["choices"][0]["text"] == "Hi!\n"
        long = {"model": MODEL, "prompt": "x" * 70, "max_tokens": 4}
        assert (await h.client.post("/v1/completions", json=long)).status_code == 200
        metrics = (await h.client.get("/metrics")).text
    assert len(p.contexts) == 1  # only the long prompt went through the prefill worker
    assert [g.handle is None for g in d.generations] == [True, False]
    assert 'pdserve_router_decisions_total{path="local_prefill"} 1.0' in metrics
    assert 'pdserve_router_decisions_total{path="disaggregated"} 1.0' in metrics
