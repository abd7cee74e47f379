"""``pdserve bench serve --url``: the client's metrics against a fake OpenAI streaming server with
known delays and token counts, error counting, the JSON report, prompts of exact length, --help."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.serving import bench_serve as bs
from pdserve.cli import build_parser, main
from tests.support.models import tiny_tokenizer
from tests.support.servers import wait_until_sync

TTFT_S = 0.08  # the fake server's delay before the first content delta
ITL_S = 0.03  # and between content deltas
PROMPT_TOKENS = 40


# --- a fake OpenAI-compatible server -------------------------------------------------------------


def fake_app(fail_every: int = 0, fail_mid_stream: bool = False) -> tuple[FastAPI, list[dict]]:
    """Chat completions that stream ``max_tokens`` one-token deltas (TTFT_S, then ITL_S apart).
    Request number k (0 = the warm-up) with ``k % fail_every == fail_every - 1`` fails: HTTP 503
    with an OpenAI error envelope, or with ``fail_mid_stream`` an SSE error event after 2 tokens."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        k = len(seen)
        seen.append(body)
        fail = fail_every and k % fail_every == fail_every - 1
        if fail and not fail_mid_stream:
            err = {"error": {"message": f"no capacity (request {k})", "type": "server_error"}}
            return JSONResponse(err, status_code=503)
        n = int(body["max_tokens"])

        def event(obj: Any) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        async def stream():  # type: ignore[no-untyped-def]
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                if fail and i == 2:
                    yield event({"error": {"message": f"worker died (request {k})"}})
                    yield b"data: [DONE]\n\n"
                    return
                finish = "length" if i == n - 1 else None
                yield event({"choices": [{"index": 0, "delta": {"content": f" t{i}"},
                                          "finish_reason": finish}]})  # fmt: skip
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                         "total_tokens": PROMPT_TOKENS + n}  # fmt: skip
                yield event({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app, seen


class ThreadServer:
    """uvicorn on a free loopback port in a thread of its own (the bench runs asyncio.run)."""

    def __init__(self, app: FastAPI) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_until_sync(lambda: self.server.started, 10, interval_s=0.02, what="the fake server")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(str(path))
    return path


def _run_cli(url: str, tokenizer_dir: Path, out: Path, *extra: str) -> int:
    return main(["bench", "serve", "--url", url, "--tokenizer", str(tokenizer_dir),
                 "--input-len", "48", "--output-len", "5", "--json", str(out), *extra])  # fmt: skip


# --- end to end against the fake server ----------------------------------------------------------


def test_metrics_from_known_delays_and_token_counts(tokenizer_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    app, seen = fake_app()
    out = tmp_path / "r.json"
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, out, "--concurrency", "1", "2", "--num-requests", "4",
                      "--label", "fake", "--seed", "3")  # fmt: skip
    assert rc == 0
    assert len(seen) == 1 + 4 + 4  # warm-up + two levels
    body = seen[0]
    assert body["model"] == "fake-model"  # asked GET /v1/models
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0
    contents = [b["messages"][0]["content"] for b in seen]
    assert len(set(contents)) == len(contents)  # every prompt differs (no prefix-cache reuse)

    report = json.loads(out.read_text())
    assert report["tool"] == "pdserve bench serve" and report["label"] == "fake"
    assert report["workload"]["input_len"] == 48 and report["workload"]["output_len"] == 5
    assert report["workload"]["seed"] == 3 and report["workload"]["ignore_eos"] is True
    (run,) = report["runs"]
    assert run["url"] == url and run["model"] == "fake-model"
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    for lv in run["levels"]:
        assert lv["num_requests"] == 4 and lv["completed"] == 4 and lv["errors"] == 0
        assert lv["first_error"] is None
        assert lv["output_tokens"] == 20 and lv["output_len_mismatch"] == 0
        assert lv["prompt_tokens_mean"] == PROMPT_TOKENS
        ttft, itl, tpot, e2e = (lv[k] for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"))
        assert set(ttft) == {"mean", "p50", "p90", "p99"}
        # Lower bounds are exact (the server sleeps that long); upper ones leave room for a
        # loaded 2-core machine.
        assert TTFT_S * 1e3 <= ttft["p50"] < TTFT_S * 1e3 + 150
        assert ITL_S * 1e3 * 0.9 <= itl["p50"] < ITL_S * 1e3 + 60
        assert ITL_S * 1e3 * 0.9 <= tpot["p50"] < ITL_S * 1e3 + 60
        assert e2e["p50"] >= (TTFT_S + 4 * ITL_S) * 1e3
        assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
        assert lv["output_tokens_per_s"] == pytest.approx(20 / lv["wall_s"])
    # Two in flight: the second level takes about half the wall time of the first.
    w1, w2 = (lv["wall_s"] for lv in run["levels"])
    assert w2 < w1 * 0.8
    text = capsys.readouterr().out
    assert "concurrency 1: 4/4 ok, 0 errors" in text and "TTFT p50" in text and "ITL" in text


@pytest.mark.parametrize("mid_stream", [False, True])
def test_errors_are_counted_with_the_first_message(tokenizer_dir: Path, tmp_path: Path,
                                                   mid_stream: bool) -> None:  # fmt: skip
    # Requests 0 (warm-up) .. 6; every third fails: 2 and 5, both in the measured level.
    app, seen = fake_app(fail_every=3, fail_mid_stream=mid_stream)
    out = tmp_path / "r.json"
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, out, "--concurrency", "1", "--num-requests", "6",
                      "--model", "named-model")  # fmt: skip
    assert rc == 0  # some requests succeeded
    assert seen[0]["model"] == "named-model"
    (lv,) = json.loads(out.read_text())["runs"][0]["levels"]
    assert lv["num_requests"] == 6 and lv["errors"] == 2 and lv["completed"] == 4
    if mid_stream:
        assert lv["first_error"] == "worker died (request 2)"
    else:
        assert lv["first_error"] == "HTTP 503: no capacity (request 2)"
    assert lv["output_tokens"] == 4 * 5  # failed requests count no tokens


def test_a_failing_warm_up_stops_the_run(tokenizer_dir: Path, tmp_path: Path) -> None:
    app, seen = fake_app(fail_every=1)
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, tmp_path / "r.json", "--concurrency", "1")
    assert rc == 1 and len(seen) == 1
    assert not (tmp_path / "r.json").exists()


def test_no_ignore_eos_leaves_the_field_out(tokenizer_dir: Path, tmp_path: Path) -> None:
    app, seen = fake_app()
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, tmp_path / "r.json", "--concurrency", "1",
                      "--num-requests", "1", "--no-ignore-eos", "--warmup", "0")  # fmt: skip
    assert rc == 0 and len(seen) == 1 and "ignore_eos" not in seen[0]


def test_unreachable_server_and_missing_tokenizer(tokenizer_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    assert _run_cli(dead, tokenizer_dir, tmp_path / "r.json", "--concurrency", "1") == 1
    assert _run_cli(dead, tmp_path / "nowhere", tmp_path / "r.json") == 2
    assert not (tmp_path / "r.json").exists()


# --- the client's parts ---------------------------------------------------------------------------


def _sse(*events: Any) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _stream(handler) -> bs.RequestResult:  # type: ignore[no-untyped-def]
    async def go() -> bs.RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await bs.stream_openai(client, "http://x/v1/chat/completions", {"model": "m"})

    return asyncio.run(go())


def test_stream_counts_content_deltas_and_takes_tokens_from_usage() -> None:
    res = _stream(lambda req: httpx.Response(200, content=_sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "ab"}}]},
        {"choices": [{"delta": {"content": "cd"}}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}},
    )))  # fmt: skip
    assert res.ok and res.output_tokens == 4 and res.prompt_tokens == 7
    assert len(res.itl_s) == 1  # two content deltas, one gap; the empty role delta is no token


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (lambda r: httpx.Response(404, json={"error": {"message": "no such model"}}),
         "HTTP 404: no such model"),
        (lambda r: httpx.Response(200, content=_sse({"choices": []})), "no content received"),
        (lambda r: httpx.Response(200, content=b"data: {not json\n\n"), "JSONDecodeError"),
    ],
)  # fmt: skip
def test_stream_failures_are_results_not_exceptions(handler, message: str) -> None:  # type: ignore[no-untyped-def]
    res = _stream(handler)
    assert not res.ok and message in (res.error or "")


def test_stream_transport_error_is_a_result() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    res = _stream(refuse)
    assert not res.ok and res.error == "ConnectError: refused"


def test_from_stamps_and_tpot() -> None:
    r = bs.from_stamps(10.0, [10.5, 10.6, 10.8], 11.0, output_tokens=5, prompt_tokens=9)
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.0)
    assert r.itl_s == pytest.approx([0.1, 0.2])
    assert r.tpot_s == pytest.approx((1.0 - 0.5) / 4)
    assert bs.from_stamps(0.0, [0.2], 0.3).tpot_s is None  # one token: no TPOT


def test_summarize_known_values() -> None:
    ok = [bs.RequestResult(ok=True, ttft_s=t, itl_s=[0.01, 0.03], e2e_s=t + 0.04,
                           output_tokens=3, prompt_tokens=10) for t in (0.1, 0.2, 0.3, 0.4, 0.5)]  # fmt: skip
    bad = [bs.RequestResult(ok=False, error="boom"), bs.RequestResult(ok=False, error="later")]
    lv = bs.summarize(ok + bad, wall_s=2.0, concurrency=4, expect_output=4)
    assert (lv["num_requests"], lv["completed"], lv["errors"]) == (7, 5, 2)
    assert lv["first_error"] == "boom"
    assert lv["output_tokens"] == 15 and lv["output_tokens_per_s"] == pytest.approx(7.5)
    assert lv["requests_per_s"] == pytest.approx(2.5)
    assert lv["output_len_mismatch"] == 5
    assert lv["ttft_ms"]["p50"] == pytest.approx(300)
    assert lv["ttft_ms"]["p90"] == pytest.approx(460)
    assert lv["ttft_ms"]["p99"] == pytest.approx(496)
    assert lv["ttft_ms"]["mean"] == pytest.approx(300)
    assert lv["itl_ms"]["p50"] == pytest.approx(20)
    assert lv["tpot_ms"]["p50"] == pytest.approx(20)
    assert lv["e2e_ms"]["p50"] == pytest.approx(340)
    table = bs.format_summary([lv], "x")
    assert "TTFT p99" in table and "300.0" in table
    assert "first error: boom" in bs.format_level(lv)


def test_percentile_interpolates_like_numpy() -> None:
    assert bs.percentile([1, 2, 3, 4], 50) == 2.5
    assert bs.percentile([5], 99) == 5
    assert bs.percentile([], 50) is None
    assert bs.percentile(list(range(101)), 90) == 90


def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    active = peak = 0

    async def one(item: int) -> bs.RequestResult:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)  # the request's duration: concurrent ones overlap
        active -= 1
        return bs.RequestResult(ok=True, output_tokens=item)

    results, wall = asyncio.run(bs.run_level(one, list(range(10)), 3))
    assert peak == 3 and sorted(r.output_tokens for r in results) == list(range(10))
    assert wall > 0


def test_prompts_have_exact_templated_length_and_a_fixed_seed() -> None:
    tok = tiny_tokenizer()
    a, b = bs.PromptMaker(tok, seed=1), bs.PromptMaker(tok, seed=1)
    prompts = [a.make(100) for _ in range(5)]
    assert prompts == [b.make(100) for _ in range(5)]
    assert len(set(prompts)) == 5
    assert all(a.count(p) == 100 for p in prompts)
    assert bs.PromptMaker(tok, seed=2).make(100) != prompts[0]


def test_base_url_and_default_request_count() -> None:
    assert bs.base_url("http://h:1") == "http://h:1/v1"
    assert bs.base_url("http://h:1/v1/") == "http://h:1/v1"
    assert [bs.default_num_requests(c) for c in (1, 8, 32)] == [16, 32, 128]


# --- the command line -----------------------------------------------------------------------------


def test_help_describes_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--help"])
    text = capsys.readouterr().out
    for opt in ("--url", "--input-len", "--output-len", "--concurrency", "--num-requests",
                "--seed", "--ignore-eos", "--no-ignore-eos", "--model", "--tokenizer", "--json",
                "--label", "TTFT", "ITL", "TPOT", "p99", "GET /v1/models"):  # fmt: skip
        assert opt in text, opt


def test_defaults_and_old_option_names() -> None:
    a = build_parser().parse_args(["bench", "serve", "--url", "http://h/v1"])
    assert (a.input_len, a.output_len, a.concurrency, a.num_requests) == (256, 64, [1, 8], None)
    assert a.ignore_eos is True and a.seed == 0 and a.warmup == 1
    old = build_parser().parse_args(
        ["bench", "serve", "--prompt-tokens", "128", "--max-tokens", "16", "--requests", "4",
         "--concurrency", "1", "8", "32"]
    )  # fmt: skip
    assert (old.input_len, old.output_len, old.num_requests) == (128, 16, 4)
    assert old.concurrency == [1, 8, 32] and old.url is None


def test_output_len_zero_sends_no_max_tokens_like_a_plain_chat_client() -> None:
    body = bs.chat_body("m", "hi", 0, ignore_eos=False)
    assert "max_tokens" not in body and "ignore_eos" not in body
    assert bs.chat_body("m", "hi", 8, ignore_eos=True)["max_tokens"] == 8


def test_a_prompt_file_supplies_the_user_messages_in_turn(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    questions = tmp_path / "q.txt"
    questions.write_text("What is 1 + 1?\n\nName a colour.\n")
    app, seen = fake_app()
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, tmp_path / "r.json", "--concurrency", "1",
                      "--num-requests", "3", "--warmup", "0",
                      "--prompt-file", str(questions))  # fmt: skip
    assert rc == 0
    assert [body["messages"][0]["content"] for body in seen] == [
        "What is 1 + 1?",
        "Name a colour.",
        "What is 1 + 1?",
    ]


# --- goodput and the open loop ---------------------------------------------------------------------


def test_slo_checks_each_target_given() -> None:
    r = bs.RequestResult(ok=True, ttft_s=0.2, itl_s=[0.01] * 9 + [0.5], e2e_s=0.2 + 0.59,
                         output_tokens=11)  # fmt: skip
    assert r.tpot_s == pytest.approx(0.059)
    assert bs.Slo(ttft_s=0.2).met(r) and not bs.Slo(ttft_s=0.19).met(r)
    assert bs.Slo(tpot_s=0.06).met(r) and not bs.Slo(tpot_s=0.05).met(r)
    # p90 of the gaps: nine of 10 ms and one of 500 ms interpolate to 59 ms
    assert bs.Slo(itl_s=0.06).met(r) and not bs.Slo(itl_s=0.05).met(r)
    assert not bs.Slo(ttft_s=1.0).met(bs.RequestResult(ok=False, error="x"))
    assert bs.Slo(ttft_s=1.0, tpot_s=1.0).met(bs.RequestResult(ok=True, ttft_s=0.1, e2e_s=0.1,
                                                                output_tokens=1))  # fmt: skip
    assert not bs.Slo() and bs.Slo(itl_s=1.0)


def test_goodput_counts_failed_requests_as_not_good() -> None:
    fast = bs.RequestResult(ok=True, ttft_s=0.1, itl_s=[0.01], e2e_s=0.11, output_tokens=2)
    slow = bs.RequestResult(ok=True, ttft_s=0.9, itl_s=[0.01], e2e_s=0.91, output_tokens=2)
    bad = bs.RequestResult(ok=False, error="x")
    lv = bs.summarize([fast, fast, slow, bad], 2.0, 4, slo=bs.Slo(ttft_s=0.5))
    assert lv["goodput"] == {"slo": {"ttft_ms": 500.0, "tpot_ms": None, "itl_ms": None},
                             "good": 2, "fraction": 0.5, "requests_per_s": 1.0}  # fmt: skip
    assert "goodput: 2/4 requests meet TTFT <= 500 ms (50 %), 1.00 good req/s" in bs.format_level(
        lv
    )
    assert bs.summarize([fast], 1.0, 1)["goodput"] is None


def test_open_loop_sends_at_seeded_poisson_arrivals_whatever_is_in_flight() -> None:
    import random

    sent: list[float] = []
    active = peak = 0

    async def one(item: int) -> bs.RequestResult:
        nonlocal active, peak
        sent.append(time.perf_counter())
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.3)  # longer than the gaps: an open loop does not wait for it
        active -= 1
        return bs.RequestResult(ok=True, output_tokens=item)

    rate = 40.0
    results, wall = asyncio.run(bs.run_rate(one, list(range(12)), rate, seed=5))
    assert sorted(r.output_tokens for r in results) == list(range(12))
    rng = random.Random(5)
    due = [0.0]
    for _ in range(11):
        due.append(due[-1] + rng.expovariate(rate))
    offsets = [t - sent[0] for t in sent]
    for got, want in zip(offsets, due, strict=True):
        assert want - 1e-3 <= got < want + 0.25  # never early; late only by scheduling
    assert peak >= 3 and wall >= due[-1] + 0.3
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(bs.run_rate(one, [1], 0.0))


def test_cli_request_rate_and_slos_report_goodput(tokenizer_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    app, seen = fake_app()
    out = tmp_path / "r.json"
    with ThreadServer(app) as url:
        rc = _run_cli(url, tokenizer_dir, out, "--request-rate", "50", "5", "--num-requests",
                      "4", "--ttft-slo-ms", "2000", "--itl-slo-ms", "10")  # fmt: skip
    assert rc == 0 and len(seen) == 1 + 4 + 4
    report = json.loads(out.read_text())
    assert report["workload"]["request_rate"] == [50.0, 5.0]
    assert report["workload"]["concurrency"] is None
    assert report["workload"]["slo"] == {"ttft_ms": 2000.0, "tpot_ms": None, "itl_ms": 10.0}
    levels = report["runs"][0]["levels"]
    assert [lv["request_rate"] for lv in levels] == [50.0, 5.0]
    for lv in levels:
        assert lv["completed"] == 4 and lv["concurrency"] is None
        # the fake server's gaps are 30 ms: no request meets a 10 ms ITL target
        assert lv["goodput"]["good"] == 0 and lv["goodput"]["fraction"] == 0.0
    # 4 arrivals at 5 req/s span about 0.6 s on average; at 50 req/s about 0.06 s
    assert levels[1]["wall_s"] > levels[0]["wall_s"]
    text = capsys.readouterr().out
    assert "rate 50 req/s: 4/4 ok" in text and "r=5" in text
    assert "goodput: 0/4 requests meet TTFT <= 2000 ms, ITL <= 10 ms (0 %)" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--request-rate", "0"], "rates must be positive"),
     (["--ttft-slo-ms", "-1"], "targets must be positive"),
     (["--request-rate", "2", "--plot", "x.png"], "does not take --request-rate")],
)  # fmt: skip
def test_bad_load_options_are_refused_before_any_request(
    extra: list[str], message: str, tokenizer_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    assert _run_cli("http://127.0.0.1:9/v1", tokenizer_dir, tmp_path / "r.json", *extra) == 2
    assert message in capsys.readouterr().err
