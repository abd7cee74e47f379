"""Structured outputs and tool calls against any OpenAI-compatible server: how often the output
is valid, what the grammar costs in inter-token latency, and how long a schema takes to compile.

``pdserve bench structured --url http://HOST:PORT/v1`` runs, in order (chat requests, seeded):

1. validity, ``--tries`` requests of each at temperature 1:
   - ``tool_choice: "required"`` with two function tools: the reply must hold at least one
     ``tool_calls`` entry naming a tool, with arguments that are JSON valid against its schema;
   - ``response_format`` json_schema (``strict``): the content must parse and validate;
   - a named ``tool_choice``, streamed: the ``tool_calls`` deltas must start with the name and
     their arguments must join into valid JSON (``--tries`` / 5 requests).
2. cost: ``--requests`` streamed requests at ``--concurrency``, unconstrained then under a
   json_schema whose one string field forces about ``--output-len`` tokens, then unconstrained
   again (the first and third pooled); ITL p50 of each and their ratio (:mod:`.bench_serve`'s
   client and statistics).
3. compile time (pdserve's grammar engine, in this process, on ``--tokenizer``): the llguidance
   tokenizer's build once, then each schema above (milliseconds).

The same command against vLLM (``vllm serve ... --enable-auto-tool-choice --tool-call-parser
hermes``) gives its side of the comparison; run one server at a time on a small machine.
Validation uses ``jsonschema`` (installed with pdserve's test extras). Benchmark code only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Za-z_/]{1,32}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,4}$"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}


def long_schema(chars: int) -> dict[str, Any]:
    """A schema whose one string must hold ``chars`` to ``chars + 20`` characters (the cost
    arm's output length)."""
    return {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": chars, "maxLength": chars + 20}},
        "required": ["story"],
        "additionalProperties": False,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench structured``."""
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL, e.g. .../v1")
    p.add_argument("--model", default=None, help="model name (default: GET /models' first)")
    p.add_argument("--tries", type=int, default=50, help="requests per validity case (50)")
    p.add_argument("--concurrency", type=int, default=8, help="cost arm concurrency (8)")
    p.add_argument("--requests", type=int, default=32, help="requests per cost arm (32)")
    p.add_argument("--output-len", type=int, default=64, help="cost arm tokens (64)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer folder for the compile timings (default: the SmolLM2 folder)",
    )
    p.add_argument("--skip-cost", action="store_true", help="validity and compile only")
    p.add_argument("--label", default=None, help="name of this run (the server)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def _valid(instance: Any, schema: dict[str, Any]) -> bool:
    import jsonschema  # type: ignore[import-untyped]  # no stubs published

    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _arguments_valid(call: dict[str, Any]) -> bool:
    fn = call.get("function") or {}
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if fn.get("name") not in params:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return False
    return _valid(args, params[fn["name"]])


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that uses tools."},
    {"role": "user", "content": "What will the weather be in Lisbon for the next 3 days?"},
]
PERSON_MESSAGES = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


async def validity(client: httpx.AsyncClient, base: str, model: str, tries: int) -> dict[str, Any]:
    """The validity counts of the three cases (module docstring, 1)."""
    url = f"{base}/chat/completions"
    required = 0
    json_ok = 0
    reasons: dict[str, int] = {}
    for seed in range(tries):
        body = {
            "model": model,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 200,
        }
        r = await client.post(url, json=body)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        calls = (choice.get("message") or {}).get("tool_calls") or []
        required += bool(calls) and all(_arguments_valid(c) for c in calls)
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        }
        body = {
            "model": model,
            "messages": PERSON_MESSAGES,
            "response_format": fmt,
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 200,
        }
        r = await client.post(url, json=body)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        reason = str(choice.get("finish_reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
        try:
            json_ok += _valid(
                json.loads((choice.get("message") or {}).get("content") or ""), PERSON
            )
        except ValueError:
            pass
    named_tries = max(1, tries // 5)
    named = 0
    for seed in range(named_tries):
        body = {
            "model": model,
            "messages": MESSAGES,
            "tools": TOOLS,
            "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 200,
        }
        pieces: list[dict[str, Any]] = []
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        pieces.extend((c.get("delta") or {}).get("tool_calls") or [])
        first = pieces[0].get("function", {}) if pieces else {}
        args = "".join((p.get("function") or {}).get("arguments") or "" for p in pieces)
        call = {"function": {"name": first.get("name"), "arguments": args}}
        named += first.get("name") == "get_weather" and _arguments_valid(call)
    return {
        "tries": tries,
        "required_valid": required,
        "json_schema_valid": json_ok,
        "json_schema_finish_reasons": reasons,
        "named_streamed_tries": named_tries,
        "named_streamed_valid": named,
    }


async def cost(
    client: httpx.AsyncClient, base: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """ITL p50 unconstrained vs under a json_schema (module docstring, 2)."""
    from pdserve.bench.serving import bench_serve as bs

    url = f"{base}/chat/completions"
    schema = long_schema(args.output_len * 3)  # about 3 characters a token
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}

    def body(i: int, constrained: bool) -> dict[str, Any]:
        prompt = f"Tell story number {i} about a lighthouse keeper."
        b = bs.chat_body(
            model,
            prompt,
            args.output_len * 2 if constrained else args.output_len,
            ignore_eos=not constrained,
        )
        if constrained:
            b["response_format"] = fmt
        return b

    async def arm(constrained: bool) -> tuple[list[Any], float]:
        items = [body(i, constrained) for i in range(args.requests)]
        return await bs.run_level(
            lambda b: bs.stream_openai(client, url, b), items, args.concurrency
        )

    await bs.stream_openai(client, url, body(-1, True))  # warm-up: compiles the schema
    plain1, wall1 = await arm(False)
    constrained, wall_c = await arm(True)
    plain2, wall2 = await arm(False)
    plain = bs.summarize(plain1 + plain2, wall1 + wall2, args.concurrency)
    json_arm = bs.summarize(constrained, wall_c, args.concurrency)
    p50 = plain["itl_ms"]["p50"], json_arm["itl_ms"]["p50"]
    return {
        "unconstrained": plain,
        "json_schema": json_arm,
        "itl_p50_ratio": (p50[1] / p50[0]) if p50[0] else None,
    }


def compile_times(tokenizer_dir: str) -> dict[str, Any]:
    """pdserve's grammar compile times on ``tokenizer_dir`` (module docstring, 3)."""
    from transformers import AutoTokenizer

    from pdserve.protocol import StructuredOutput
    from pdserve.server.chat.tool_calls import ToolPlan
    from pdserve.workers.engine.sampling.grammar_masks import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    compiler = GrammarCompiler(tok, len(tok), eos)
    t0 = time.perf_counter()
    compiler._tokenizer()
    out: dict[str, Any] = {"tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    required = ToolPlan(mode="required", tools=tuple(TOOLS)).constraint()
    assert required is not None
    cases = {
        "person json_schema": StructuredOutput(kind="json", spec=json.dumps(PERSON)),
        "tool_choice required (2 tools)": required,
        "story json_schema": StructuredOutput(kind="json", spec=json.dumps(long_schema(192))),
        "regex": StructuredOutput(kind="regex", spec="[0-9]{3}-[a-z]{2,8}"),
    }
    for name, so in cases.items():
        t0 = time.perf_counter()
        compiler.prepare(so)
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print the figures (and write ``--json``). Returns the exit code."""
    import httpx

    from pdserve.bench.serving import bench_serve as bs

    base = args.url.rstrip("/")

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=args.concurrency + 2)
        async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
            model = args.model or await bs.served_model(client, base)
            result: dict[str, Any] = {"label": args.label or base, "model": model}
            result["validity"] = await validity(client, base, model, args.tries)
            if not args.skip_cost:
                result["cost"] = await cost(client, base, model, args)
            return result

    result = asyncio.run(run())
    tokenizer = args.tokenizer or str(bs.default_tokenizer(None))
    result["compile_ms"] = compile_times(tokenizer)
    v = result["validity"]
    print(f"{result['label']} ({result['model']}):")
    print(f"  tool_choice required: {v['required_valid']}/{v['tries']} schema-valid calls")
    print(
        f"  json_schema strict:   {v['json_schema_valid']}/{v['tries']} parse and validate "
        f"(finish reasons {v['json_schema_finish_reasons']})"
    )
    print(
        f"  named, streamed:      {v['named_streamed_valid']}/{v['named_streamed_tries']} "
        "deltas join into valid arguments"
    )
    if "cost" in result:
        c = result["cost"]
        u, j = c["unconstrained"], c["json_schema"]
        print(
            f"  ITL p50 at concurrency {args.concurrency}: unconstrained "
            f"{u['itl_ms']['p50']:.1f} ms, json_schema {j['itl_ms']['p50']:.1f} ms "
            f"(ratio {c['itl_p50_ratio']:.2f}); output tok/s {u['output_tokens_per_s']:.1f} "
            f"vs {j['output_tokens_per_s']:.1f}"
        )
    ms = result["compile_ms"]
    print("  pdserve grammar compile: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    if args.json:
        from pathlib import Path

        bs.write_json(Path(args.json), result)
    return 0
