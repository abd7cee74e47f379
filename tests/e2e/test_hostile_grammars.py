"""Hostile structured outputs against a real stack (router + prefill + decode worker processes
on the tiny model), issue 39's findings:

1. The probe's 1.38 MB GBNF of 50,000 chained rules, two copies at once, is a 400 in well under
   a second while a plain completion is served (was: no answer in 300 s, both tokenizer threads
   held, every plain request timed out). A schema of 5000 chained ``$ref``s, small enough to
   pass the caps, crashes llguidance's compiler (a segmentation fault): a 400, in the checker's
   child, and the router serves on.
2. A grammar that fails while decoding ends its request at once with a 400 ``grammar_failed``
   (streamed: the stream's error event), on the prefill or the decode worker, with one log line
   (was: treated as a worker failure, 502 after 30-36 s, llguidance's state dump with the
   client's grammar logged twice).
3. 300 distinct pathological regexes ``(a{1000+i}){1000}`` leave each worker's RSS within the
   grammar cache's byte bound plus a fixed slack (was: about 160 MB kept per regex, an OOM
   kill near 256).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.workers.engine.sampling.grammar_masks import CACHE_BYTES
from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
RSS_SLACK = 160 << 20
"""What the decode worker's RSS may grow past the grammar cache's byte bound over 300
pathological regexes (allocator fragmentation, the compiler thread, the tokenizer's matcher)."""


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir, MODEL, tmp_path_factory.mktemp("grammars"))
    yield stack
    stack.stop()


def completion(stack: Stack, timeout: float = 60, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=timeout)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_50k_rule_gbnf_is_refused_at_once_while_a_plain_request_is_served(
    stack: Stack,
) -> None:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(50_000))
    gbnf = f'root ::= r0\n{body}r50000 ::= "b"\n'
    assert len(gbnf) > 1_000_000
    with ThreadPoolExecutor(3) as pool:
        t0 = time.monotonic()
        hostile = [
            pool.submit(completion, stack, structured_outputs={"grammar": gbnf}) for _ in range(2)
        ]
        plain = pool.submit(completion, stack)
        answers = [f.result() for f in hostile]
        elapsed = time.monotonic() - t0
        assert plain.result().status_code == 200, plain.result().text
    for r in answers:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs.grammar" and "at most" in error["message"]
    assert elapsed < 1.0, f"two 1.1 MB grammars took {elapsed:.2f} s to refuse"


def test_a_schema_that_crashes_the_compiler_is_a_400_and_the_router_serves_on(
    stack: Stack,
) -> None:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    defs["d5000"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    r = completion(stack, structured_outputs={"json": schema})
    assert r.status_code == 400, r.text
    assert "nests too deeply" in r.json()["error"]["message"]
    assert stack.procs["router"].popen.poll() is None
    assert completion(stack, structured_outputs={"json": {"type": "object"}}).status_code == 200


def test_a_grammar_failing_mid_way_is_a_400_at_once_with_one_log_line(stack: Stack) -> None:
    regex = {"regex": "(a{1000}){999}"}
    t0 = time.monotonic()
    r = completion(stack, structured_outputs=regex)
    assert time.monotonic() - t0 < 5.0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_failed" and "\n" not in error["message"]
    request_id = error["request_id"]
    assert request_id
    # streamed, failing at the fourth token: three tokens, then the stream's error event
    body = {"model": MODEL, "prompt": "a", "max_tokens": 8, "stream": True, "temperature": 0,
            "structured_outputs": {"regex": "[a-c]{3}(d{1000}){1000}"}}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert len(text) == 3 and set(text) <= set("abc"), events
    assert events[-1]["error"]["code"] == "grammar_failed", events
    # the prefill worker's path too: a prompt long enough to be handed off
    long = completion(stack, prompt=[1, *(40 + i % 200 for i in range(300))],
                      structured_outputs={"regex": "(a{1000}){997}"})  # fmt: skip
    assert long.status_code == 400 and long.json()["error"]["code"] == "grammar_failed"
    # one line per failure, on the worker that sampled the token, without the grammar's text
    lines = [
        line
        for name in ("prefill-0", "decode-0")
        for line in stack.procs[name].log().splitlines()
        if "structured output failed" in line and " WARNING " in line
    ]
    assert len(lines) == 3, lines
    assert all("a{1000}" not in line and "<state>" not in line for line in lines)


def test_300_distinct_pathological_regexes_leave_the_workers_rss_bounded(
    stack: Stack,
) -> None:
    pids = {name: stack.procs[name].popen.pid for name in ("prefill-0", "decode-0")}
    completion(stack, structured_outputs={"regex": "(a{999}){1000}"})  # warm: the compiler up
    before = {name: rss_bytes(pid) for name, pid in pids.items()}
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        r = completion(stack, structured_outputs={"regex": f"(a{{{1000 + i}}}){{1000}}"})
        with lock:
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(300)))
    grown = {name: rss_bytes(pid) - before[name] for name, pid in pids.items()}
    # each fails on its first token (the lexer's fuel): the request's own 400, none a 5xx
    assert statuses == {400: 300}, statuses
    for name, by in grown.items():  # the prefill worker compiles them (it samples token 1)
        assert by <= CACHE_BYTES + RSS_SLACK, f"{name} grew {by >> 20} MiB"
    assert completion(stack).status_code == 200
