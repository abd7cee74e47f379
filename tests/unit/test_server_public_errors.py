"""No public error body names the deployment's inside: whatever a worker, a transfer or the
router's own routing says (worker ids, internal addresses, peers), a client of ``/v1`` reads
the status, type, code and a public message; the full message is in the router's log under
the request id the body names."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.errors import (
    CapacityError,
    DeadlineExceededError,
    DiscoveryError,
    HandleError,
    IntegrityError,
    InvalidRequestError,
    LayoutMismatchError,
    PdserveError,
    QueueFullError,
    TransferError,
    WorkerError,
)
from pdserve.protocol import Role
from pdserve.router.client import error_from_envelope
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

PREFILL, DECODE = "prefill-secret-7", "decode-secret-9"
INSIDE = "transfer peer 10.44.0.7:45123 of worker node-17.cluster.internal"
"""What workers put in their messages here: an internal address and host name."""
LEAKS = re.compile(r"secret-|10\.44\.|45123|node-17|127\.0\.0\.1|:\d{2,5}\b")
REPLY = [(72, "H"), (105, "i"), (33, "!")]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    path = build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)
    # failures reach the client here: no migration, no wait for a worker
    router = RouterSettings(migration_limit=0, worker_wait_s=0.0)
    return RouterConfig(model_path=path, served_model_name=MODEL, router=router)


def pair(**decode_kw: object) -> list[FakeWorker]:
    return [
        FakeWorker(PREFILL, Role.PREFILL, REPLY),
        FakeWorker(DECODE, Role.DECODE, REPLY, **decode_kw),  # type: ignore[arg-type]
    ]


WORKER_ERRORS = [
    WorkerError(f"engine of {DECODE} died at {INSIDE}"),
    TransferError(f"KV pull from {INSIDE} timed out"),
    HandleError(f"handle names worker {PREFILL} epoch 3, but {INSIDE} serves another"),
    IntegrityError(f"request r: decode block 4 (from {PREFILL} block 9) arrived corrupted"),
    LayoutMismatchError(f"{PREFILL} and {DECODE} differ in num_kv_heads ({INSIDE})"),
    CapacityError(f"cannot reserve 9 KV blocks on {DECODE}: 2 of 8 available ({INSIDE})"),
    QueueFullError(f"12 requests are waiting on {DECODE} (max_queued_requests) at {INSIDE}"),
    DeadlineExceededError(f"{PREFILL} did not answer before the deadline ({INSIDE})"),
    DiscoveryError(f"etcd at {INSIDE} unreachable"),
    PdserveError(f"unexpected failure on {DECODE} at {INSIDE}"),
]


def assert_public(err: dict[str, object], caplog: pytest.LogCaptureFixture) -> None:
    """``err`` (an error body's ``error``) names nothing internal, and the router logged the
    whole story under the request id it names."""
    text = json.dumps(err)
    assert not LEAKS.search(text), f"an internal detail reached the client: {text}"
    rid = str(err["request_id"])
    assert rid and any(
        rid in r.getMessage() and ("secret-" in r.getMessage() or "10.44" in r.getMessage())
        for r in caplog.records
    ), f"the router did not log the details under {rid}"


@pytest.mark.parametrize("exc", WORKER_ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_failure_reaches_the_client_without_internal_names(
    cfg, caplog, exc, leg, stream
):
    workers = pair()
    workers[0 if leg == "prefill" else 1].error = exc
    caplog.set_level("INFO")
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    if r.status_code == 200:  # a stream that started: the failure is its in-band event
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        err = next(json.loads(e)["error"] for e in events if '"error"' in e)
    else:
        err = r.json()["error"]
    # The status and code the router maps the worker's answer to (the mapping has its own
    # tests in test_server_errors): what matters here is what the body says.
    seen = error_from_envelope("leg", exc.status, json.dumps(exc.to_json()).encode())
    assert r.status_code in (200, seen.status), r.text
    assert (err["code"], err["type"]) == (seen.code, seen.type)
    assert err["message"] == seen.public_message
    if isinstance(exc, TransferError):  # the subclass survives the hop: its own public text
        assert type(seen) is type(exc) and err["message"] == exc.public_text
    assert_public(err, caplog)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_failure_mid_stream_names_no_worker(cfg, caplog, stream):
    async with router_harness(cfg, pair(fail_after=1)) as h:
        r = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                         "stream": stream})  # fmt: skip
    if stream:
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        err = next(json.loads(e)["error"] for e in events if '"error"' in e)
    else:
        err = r.json()["error"]
    assert err["code"] == "worker_error"
    assert_public(err, caplog)


async def test_an_unreachable_worker_is_reported_without_its_address(cfg, caplog):
    async with router_harness(cfg, pair()) as h:
        gone = FakeWorker(DECODE, Role.DECODE, REPLY, http_url="http://127.0.0.1:9")
        h.watcher.put(gone.record())  # nothing listens there: connection refused
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_unreachable", r.text
    assert_public(r.json()["error"], caplog)


async def test_no_usable_worker_is_a_503_naming_the_missing_role_not_the_workers(cfg, caplog):
    workers = [FakeWorker(PREFILL, Role.PREFILL, REPLY)]  # no decode worker at all
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "no_worker"
    assert "decode" in err["message"] and not LEAKS.search(json.dumps(err))


async def test_a_workers_refusal_of_the_request_reaches_the_client_in_its_own_words(cfg):
    workers = pair()
    workers[0].error = InvalidRequestError("prompt token 7 is not in the vocabulary")
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] == "prompt token 7 is not in the vocabulary"
