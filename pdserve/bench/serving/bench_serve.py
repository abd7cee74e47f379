"""Serving benchmark client: drive an OpenAI-compatible server with a fixed-seed workload.

``pdserve bench serve --url http://HOST:PORT/v1`` loads an already running server (pdserve, vLLM,
anything that speaks the OpenAI API with the ``ignore_eos`` extension) with synthetic chat
requests: each prompt is fixed-seed random words that the chat template and tokenizer turn into
``input_len`` tokens, each request asks for ``output_len`` tokens (streaming, greedy,
``ignore_eos`` by default so that every request produces exactly that many). A closed loop keeps
``concurrency`` requests in flight until ``num_requests`` have finished, for each level in turn;
one warm-up request goes first and is not counted.

Per request (all client-side, ``time.perf_counter``):

- TTFT: seconds from sending the request to the first non-empty content delta.
- ITL: seconds between consecutive non-empty content deltas (all gaps of all requests pooled).
- TPOT: ``(e2e - TTFT) / (output_tokens - 1)`` seconds, output tokens from the final ``usage``.
- e2e: seconds from sending the request to the end of its stream.

Per level: output tokens/s = output tokens of the successful requests / the level's wall time
(first request sent to last stream ended); errors = failed requests (HTTP status, an error event
in the stream, a transport error, no content) with the first message. Reports print milliseconds.

Goodput (DistServe, OSDI'24; vLLM's ``--goodput``): with service-level objectives
(:class:`Slo`: TTFT, TPOT and/or ITL targets) a request is *good* when it succeeded and meets
every target given: TTFT <= the TTFT target, TPOT <= the TPOT target, and its 90th-percentile ITL
<= the ITL target (one gap in ten may stall, on a prefill chunk for instance). Goodput = good
requests / the level's wall time (requests/s), reported beside the fraction of good requests.

Open loop (:func:`run_rate`): instead of a fixed concurrency, requests are sent at Poisson
arrivals of a given rate (exponential gaps from a seeded generator), whatever is in flight, as
a population of independent users would send them.

This module is benchmark code only: the router and the workers never import it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request. Times are seconds; ``itl_s`` holds the gaps between content deltas;
    ``text`` is the streamed content (:func:`stream_openai` fills it)."""

    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``, when the server sent a usage chunk."""

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first: ``(e2e - TTFT) / (output_tokens - 1)``."""
        if not self.ok or self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def failed(t0: float, message: str) -> RequestResult:
    return RequestResult(ok=False, error=message, e2e_s=time.perf_counter() - t0)


def from_stamps(
    t0: float,
    stamps: Sequence[float],
    end: float,
    output_tokens: int | None = None,
    prompt_tokens: int | None = None,
) -> RequestResult:
    """A result from the send time ``t0``, the arrival time of each content delta and the end of
    the stream (``perf_counter`` seconds). ``output_tokens`` defaults to the number of deltas."""
    if not stamps:
        return RequestResult(ok=False, error="no content received", e2e_s=end - t0)
    return RequestResult(
        ok=True,
        ttft_s=stamps[0] - t0,
        itl_s=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        e2e_s=end - t0,
        output_tokens=output_tokens if output_tokens is not None else len(stamps),
        prompt_tokens=prompt_tokens,
    )


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _body_error(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:300]
    if isinstance(data, dict) and "error" in data:
        return _error_text(data["error"])
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return str(data)[:300]


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent-events stream, in order, up to ``[DONE]``
    (other lines skipped). Raises ValueError for a chunk that is not JSON, httpx.HTTPError
    for a broken stream."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_openai(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    kind: str = "chat",
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST one streaming request to ``url`` (``.../chat/completions`` for ``kind="chat"``,
    ``.../completions`` for ``"completions"``; ``headers`` added to the client's) and time its
    SSE content deltas (their text goes to ``text``). Never raises:
    a failure is a result with ``ok=False``."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return failed(t0, f"HTTP {r.status_code}: {_body_error(await r.aread())}")
            async for chunk in sse_chunks(r):
                if chunk.get("error"):
                    return failed(t0, _error_text(chunk["error"]))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content")
                        if kind == "chat"
                        else choice.get("text")
                    )
                    if text:
                        stamps.append(time.perf_counter())
                        parts.append(text)
    except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
        return failed(t0, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    usage = usage or {}
    result = from_stamps(
        t0, stamps, end, usage.get("completion_tokens"), usage.get("prompt_tokens")
    )
    result.text = "".join(parts)
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]
    return result


async def run_rate(
    one: Callable[[Any], Awaitable[RequestResult]], items: Sequence[Any], rate: float, seed: int = 0
) -> tuple[list[RequestResult], float]:
    """Open loop: send ``items`` at Poisson arrivals of ``rate`` requests/s (exponential gaps,
    ``random.Random(seed)``; the first goes at once), each as soon as its time comes whatever
    is still in flight. Returns the results (in completion order) and the wall time in seconds
    (first sent to last finished). Raises ValueError for a rate that is not positive."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    results: list[RequestResult] = []

    async def send(item: Any) -> None:
        results.append(await one(item))

    t0 = time.perf_counter()
    due = 0.0
    tasks = []
    for i, item in enumerate(items):
        if i:
            due += rng.expovariate(rate)
        wait = t0 + due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(send(item)))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def run_level(
    one: Callable[[Any], Awaitable[RequestResult]], items: Sequence[Any], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Closed loop: ``concurrency`` workers each send the next item until all are done. Returns
    the results (in completion order) and the wall time in seconds."""
    todo = iter(items)
    results: list[RequestResult] = []

    async def worker() -> None:
        for item in todo:
            results.append(await one(item))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items))))))
    return results, time.perf_counter() - t0


# --- synthetic prompts ---------------------------------------------------------------------------

_WORD = re.compile(r"^ ?[A-Za-z]+$")


class PromptMaker:
    """Fixed-seed random prompts whose chat-templated form has ``input_len`` tokens.

    Prompts are random words drawn from the tokenizer's own single-token words, so that the
    text re-tokenizes (almost always) to the drawn tokens; a few passes trim or pad to the exact
    count. Each prompt starts differently, so a prefix cache shares only the template's prefix.
    """

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        words = [i for i, t in zip(ids, texts, strict=True) if _WORD.match(t)]
        spaced = [
            i for i, t in zip(ids, texts, strict=True) if _WORD.match(t) and t.startswith(" ")
        ]
        self.pool = spaced if len(spaced) >= 1000 else (words or ids)

    def count(self, content: str) -> int:
        """Tokens of ``content`` as one user message, chat template applied."""
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def make(self, input_len: int) -> str:
        """One prompt; its templated length is ``input_len`` when reachable (at least the
        template's own length)."""
        need = max(1, input_len - self.count(""))
        ids = [self.rng.choice(self.pool) for _ in range(need)]
        text: str = self.tok.decode(ids)
        for _ in range(10):
            diff = self.count(text) - input_len
            if diff == 0:
                break
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if diff > 0:
                ids = ids[: max(1, len(ids) - diff)]
            else:
                ids = ids + [self.rng.choice(self.pool) for _ in range(-diff)]
            text = self.tok.decode(ids)
        return text


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# --- metrics and reports -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 of seconds, in milliseconds (None when empty)."""
    ms = [v * 1e3 for v in values_s]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


@dataclass(frozen=True)
class Slo:
    """Service-level objectives of one request, seconds (None: no target). See the module
    docstring for what each target checks."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.itl_s))

    def met(self, r: RequestResult) -> bool:
        """Whether ``r`` succeeded and meets every target (a TPOT target is met by a request of
        one output token, which has no TPOT; likewise ITL)."""
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        tpot = r.tpot_s
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        itl = percentile(r.itl_s, 90)
        return self.itl_s is None or itl is None or itl <= self.itl_s

    def as_ms(self) -> dict[str, float | None]:
        """The targets in milliseconds, JSON-ready."""
        return {
            f"{k}_ms": None if v is None else v * 1e3
            for k, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("itl", self.itl_s))
        }


def goodput(results: Sequence[RequestResult], wall_s: float, slo: Slo) -> dict[str, Any]:
    """``{"slo", "good", "fraction", "requests_per_s"}``: requests meeting ``slo``, their
    share of all requests (failed ones count as not good) and their rate over ``wall_s``."""
    good = sum(slo.met(r) for r in results)
    return {
        "slo": slo.as_ms(),
        "good": good,
        "fraction": good / len(results) if results else None,
        "requests_per_s": good / wall_s if wall_s > 0 else None,
    }


def slo_from_args(args: Any) -> Slo:
    """``pdserve bench serve``'s ``--*-slo-ms`` targets as an :class:`Slo` (seconds)."""

    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1e3

    return Slo(s(args.ttft_slo_ms), s(args.tpot_slo_ms), s(args.itl_slo_ms))


def check_load_arguments(args: Any) -> str | None:
    """What is wrong with ``pdserve bench serve``'s load options (``--request-rate``,
    ``--concurrency``, ``--*-slo-ms``): a message, or None."""
    if any(r <= 0 for r in args.request_rate or ()):
        return "--request-rate: rates must be positive"
    if any(c < 1 for c in args.concurrency):
        return "--concurrency: levels must be at least 1"
    if any(v is not None and v <= 0 for v in (args.ttft_slo_ms, args.tpot_slo_ms, args.itl_slo_ms)):
        return "--ttft-slo-ms, --tpot-slo-ms, --itl-slo-ms: targets must be positive"
    return None


def summarize(
    results: Sequence[RequestResult],
    wall_s: float,
    concurrency: int | None,
    expect_output: int | None = None,
    slo: Slo | None = None,
    request_rate: float | None = None,
) -> dict[str, Any]:
    """One level's numbers (JSON-ready): counts, ``wall_s`` seconds, output tokens/s, and
    ``ttft_ms``/``itl_ms``/``tpot_ms``/``e2e_ms`` as mean, p50, p90, p99 in milliseconds.
    ``expect_output``: count successful requests whose output token count differs from it.
    ``slo``: add ``goodput`` (:func:`goodput`); ``request_rate``: the open loop's rate (then
    ``concurrency`` is None)."""
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "request_rate": request_rate,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "prompt_tokens_min": min(prompts) if prompts else None,
        "prompt_tokens_max": max(prompts) if prompts else None,
        "output_tokens_mean": out_tokens / len(ok) if ok else None,
        "output_len_mismatch": (
            sum(r.output_tokens != expect_output for r in ok) if expect_output is not None else None
        ),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput": goodput(results, wall_s, slo) if slo else None,
    }


def level_name(lv: dict[str, Any]) -> str:
    """``concurrency C`` or ``rate R req/s``."""
    if lv.get("request_rate") is not None:
        return f"rate {lv['request_rate']:g} req/s"
    return f"concurrency {lv['concurrency']}"


def _f(v: float | None, width: int = 9, digits: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def format_level(lv: dict[str, Any], label: str | None = None) -> str:
    """A readable block for one level: counts, throughput, then one row per metric (ms)."""
    head = (
        f"{label + ': ' if label else ''}{level_name(lv)}: "
        f"{lv['completed']}/{lv['num_requests']} ok, {lv['errors']} errors, "
        f"wall {lv['wall_s']:.1f} s, {_f(lv['output_tokens_per_s'], 0)} output tok/s, "
        f"{_f(lv['requests_per_s'], 0, 2)} req/s"
    )
    lines = [head]
    if lv["prompt_tokens_mean"] is not None:
        lines.append(
            f"  prompt tokens: mean {lv['prompt_tokens_mean']:.1f}, "
            f"min {lv['prompt_tokens_min']}, max {lv['prompt_tokens_max']}; "
            f"output tokens mean {_f(lv['output_tokens_mean'], 0)}"
        )
    if lv.get("output_len_mismatch"):
        lines.append(
            f"  WARNING: {lv['output_len_mismatch']} requests did not produce output-len tokens"
        )
    if lv["first_error"]:
        lines.append(f"  first error: {lv['first_error']}")
    if gp := lv.get("goodput"):
        targets = ", ".join(
            f"{k[:-3].upper()} <= {v:g} ms" for k, v in gp["slo"].items() if v is not None
        )
        lines.append(
            f"  goodput: {gp['good']}/{lv['num_requests']} requests meet {targets} "
            f"({100 * (gp['fraction'] or 0):.0f} %), "
            f"{_f(gp['requests_per_s'], 0, 2)} good req/s"
        )
    lines.append(f"  {'ms':<6}" + "".join(f"{h:>9}" for h in ("mean", "p50", "p90", "p99")))
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = lv[f"{name}_ms"]
        lines.append(
            f"  {name.upper():<6}" + "".join(_f(s[k]) for k in ("mean", "p50", "p90", "p99"))
        )
    return "\n".join(lines)


def format_summary(
    levels: Sequence[dict[str, Any]], label: str | None = None, header: bool = True
) -> str:
    """One row per level: concurrency (or request rate ``r=``), requests, errors, output tok/s,
    goodput (good req/s and %, ``-`` without SLOs), TTFT/ITL/TPOT p50/p90/p99."""
    cols = [f"{m} {p}" for m in ("TTFT", "ITL", "TPOT") for p in ("p50", "p90", "p99")]
    lines = [
        f"{'label':<14} {'conc':>6} {'reqs':>5} {'err':>4} {'tok/s':>7} {'good/s':>6} "
        f"{'good%':>5} " + " ".join(f"{c:>9}" for c in cols) + "   (ms)"
    ][: int(header)]
    for lv in levels:
        vals = [lv[f"{m}_ms"][f"p{p}"] for m in ("ttft", "itl", "tpot") for p in PERCENTILES]
        rate = lv.get("request_rate")
        conc = f"r={rate:g}" if rate is not None else str(lv["concurrency"])
        gp = lv.get("goodput") or {}
        frac = gp.get("fraction")
        lines.append(
            f"{(label or '-')[:14]:<14} {conc:>6} {lv['num_requests']:>5} "
            f"{lv['errors']:>4} {_f(lv['output_tokens_per_s'], 7)} "
            f"{_f(gp.get('requests_per_s'), 6, 2)} "
            f"{_f(None if frac is None else 100 * frac, 5, 0)} " + " ".join(_f(v) for v in vals)
        )
    return "\n".join(lines)


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


# --- the chat workload ----------------------------------------------------------------------------


def base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def default_num_requests(concurrency: int) -> int:
    return max(16, 4 * concurrency)


def chat_body(model: str, prompt: str, output_len: int, ignore_eos: bool) -> dict[str, Any]:
    """A streaming greedy chat request; ``output_len <= 0`` sends no ``max_tokens``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if output_len > 0:
        body["max_tokens"] = output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    """The first model id of ``GET {base}/models``."""
    r = await client.get(f"{base}/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def default_tokenizer(model: str | None, cache_dir: Path | None = None) -> Path:
    """``model`` when it is a local folder, else the converted SmolLM2 folder in the cache."""
    from pdserve.config.settings import DEFAULT_MODEL, default_cache_dir

    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    return Path(cache_dir or default_cache_dir()) / DEFAULT_MODEL
