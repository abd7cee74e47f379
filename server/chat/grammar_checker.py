"""The router's grammar checker: a request's structured output compiled in a child process,
under a deadline, off every path a plain request needs.

Why a process: a constraint is the client's program for llguidance, and the probe of issue 39
found three ways it costs more than its size. llguidance's GBNF converter is pure Python and
quadratic in the rules (50,000 chained rules held a tokenizer thread for more than 300 s);
its Rust compiler recurses once per chained rule or ``$ref`` (about 3000 overflow an 8 MiB
stack: a segmentation fault, which in the router's own process would end the router); and a
thread cannot be stopped. Here the work runs in a child that the router kills when the
deadline passes, and a crash of the child costs only that request (a 400).

Lifecycle of one check (:meth:`GrammarChecker.check`):

    1 ADMIT     size caps first (:func:`pdserve.grammar.check_size`, in the tokenizer pool);
                then a place in the checker's queue: at most ``max_waiting`` checks wait or
                run, else 429 ``grammar_busy`` at once
    2 SPAWN     on first use (or after a kill): start ``python -m
                pdserve.server.chat.grammar_checker`` and send it the tokenizer (the fast
                tokenizer's JSON, the logits' width, the EOS ids); it answers when its
                llguidance tokenizer is built (``SPAWN_TIMEOUT_S`` at most)
    3 CHECK     one framed JSON request; the child converts GBNF to Lark, compiles the
                matcher over the real vocabulary with :func:`pdserve.grammar.parser_limits`
                (what the workers use) and computes the first token mask, on a thread with
                an 8 MiB stack (the workers give their grammar threads 64 MiB, so what
                passes here has room there)
    4 ANSWER    the normalized constraint (GBNF sent as Lark, so no worker converts it
                again), or the child's 400 message; past ``deadline_s`` the child is killed
                (400: too complex), and a dead child is a 400 (too deeply nested)

Checks run one at a time (one child); a client that disconnects mid-check does not cut the
exchange (it finishes under the deadline, so the pipe stays in step). Lifecycle of the
checker: created by the router's lifespan, :meth:`close` at shutdown (idempotent; kills the
child).

Wire format on the child's stdin/stdout: a 4-byte big-endian length, then UTF-8 JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy
from dataclasses import replace
from typing import Any

from pdserve.errors import InvalidRequestError, PdserveError, QueueFullError
from pdserve.grammar import check, check_size
from pdserve.protocol import StructuredOutput
from pdserve.server.chat.preprocess import Prepared

log = logging.getLogger(__name__)

CHECK_DEADLINE_S = 3.0
"""Longest a constraint may take to convert, compile and give its first mask (the slowest
accepted one, 500 chained GBNF rules, takes about 0.25 s on an idle 2-core machine)."""

SPAWN_TIMEOUT_S = 60.0
"""Longest the child may take to start and build its tokenizer (about 1 s)."""

MAX_WAITING = 8
"""Checks waiting or running at most; the next one is refused with 429 ``grammar_busy``."""

KNOWN_ENTRIES = 512
KNOWN_BYTES = 16 << 20
"""The answers the checker remembers (least recently used out, at most this many and this many
bytes of spec): an agent sends the same tools every turn, and a hostile client the same
grammar, so most checks are a dictionary lookup. A deadline miss is not remembered (it may
be the machine's load, not the grammar)."""

CHECK_STACK_BYTES = 8 << 20
"""Stack of the child's compile thread (the usual ``ulimit -s``). Workers compile and mask on
threads with :data:`pdserve.workers.engine.sampling.grammar_masks.GRAMMAR_STACK_BYTES`, eight times more."""

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
"""Largest frame either side reads (the tokenizer's JSON is the largest: about 3.5 MB for a
49k vocabulary)."""


def tokenizer_json(tokenizer: Any) -> str:
    """A Hugging Face fast tokenizer as the JSON llguidance builds its own from (padding and
    truncation off, as llguidance's ``from_tokenizer`` does). Raises ValueError for a slow
    tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured outputs need a fast tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


class GrammarChecker:
    """Compiles requests' structured outputs in a child process (module docstring).

    ``tokenizer``: the model's fast tokenizer; ``vocab_size``: the logits' width (the first mask
    is computed over it, as on the workers); ``eos_token_ids``: the tokens that end a choice.
    Use from one event loop.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        deadline_s: float = CHECK_DEADLINE_S,
        max_waiting: int = MAX_WAITING,
    ):
        self._tokenizer = tokenizer
        self._init = {"vocab_size": vocab_size, "eos": sorted(eos_token_ids)}
        self.deadline_s = deadline_s
        self.max_waiting = max_waiting
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._known: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._known_bytes = 0
        self.checked = 0  # checks answered by the child (tests, metrics)
        self.killed = 0  # children killed at the deadline or found dead

    async def check(self, so: StructuredOutput, param: str) -> StructuredOutput:
        """``so`` checked and normalized (GBNF as Lark). Raises InvalidRequestError (400)
        naming ``param`` when it is too large, does not compile, hits a parser limit, takes
        longer than the deadline or crashes the compiler; QueueFullError (429
        ``grammar_busy``) when ``max_waiting`` checks are already queued."""
        check_size(so, param)
        key = so.key()
        answer = self._known.get(key)
        if answer is not None:
            self._known.move_to_end(key)
            return _answered(so, param, answer)
        if self._waiting >= self.max_waiting:
            raise QueueFullError(
                "too many structured outputs are being compiled; retry shortly",
                code="grammar_busy",
            )
        self._waiting += 1
        try:
            exchange = asyncio.ensure_future(self._exchange(so, param))
            answer = await asyncio.shield(exchange)  # a disconnect must not cut the exchange
        finally:
            self._waiting -= 1
        if not answer.get("transient"):
            self._remember(key, answer)
        return _answered(so, param, answer)

    def _remember(self, key: str, answer: dict[str, Any]) -> None:
        if key in self._known:
            return
        self._known[key] = answer
        self._known_bytes += len(key)
        while len(self._known) > KNOWN_ENTRIES or self._known_bytes > KNOWN_BYTES:
            old, _ = self._known.popitem(last=False)
            self._known_bytes -= len(old)

    async def _exchange(self, so: StructuredOutput, param: str) -> dict[str, Any]:
        async with self._lock:
            proc = await self._child()
            assert proc.stdin is not None and proc.stdout is not None
            request = {"kind": so.kind, "spec": so.spec, "whitespace": so.whitespace}
            request["param"] = param
            try:
                _write(proc.stdin, request)
                await proc.stdin.drain()
                return await asyncio.wait_for(_read(proc.stdout), self.deadline_s)
            except TimeoutError:
                await self._kill("past the deadline")
                limit = f"{self.deadline_s:g} s"
                return {"error": f"too complex: not compiled within {limit}", "transient": True}
            except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                await self._kill(f"died ({exc!r})")
                return {"error": "nests too deeply to compile"}
            finally:
                self.checked += 1

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            init = {**self._init, "tokenizer": await asyncio.to_thread(self._tokenizer_json)}
            _write(proc.stdin, init)
            await proc.stdin.drain()
            ready = await asyncio.wait_for(_read(proc.stdout), SPAWN_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise PdserveError(f"the grammar checker did not start: {exc!r}") from None
        if "error" in ready:
            proc.kill()
            await proc.wait()
            raise PdserveError(f"the grammar checker did not start: {ready['error']}")
        self._proc = proc
        return proc

    def _tokenizer_json(self) -> str:
        return tokenizer_json(self._tokenizer)

    async def _kill(self, why: str) -> None:
        proc, self._proc = self._proc, None
        self.killed += 1
        log.warning("grammar checker child %s; a new one starts with the next check", why)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Kill the child (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def checked(checker: GrammarChecker, batch: list[Prepared]) -> list[Prepared]:
    """``batch`` (one request's prepared prompts) with its structured output checked and
    normalized by ``checker`` (once: every prompt of a request carries the same constraint).
    Raises what :meth:`GrammarChecker.check` raises."""
    first = batch[0]
    so, param = first.sampling.structured, first.structured_param
    if so is None or param is None:
        return batch
    norm = await checker.check(so, param)
    if norm is so:
        return batch
    return [replace(p, sampling=p.sampling.model_copy(update={"structured": norm})) for p in batch]


def _answered(so: StructuredOutput, param: str, answer: dict[str, Any]) -> StructuredOutput:
    """The checked constraint of the child's ``answer``; raises its error as a 400 naming
    ``param`` (a remembered answer may come from a request that sent it in another field)."""
    if "error" in answer:
        message = str(answer["error"])
        field = str(answer.get("param", ""))
        if field and message.startswith(field):
            message = message[len(field) :].lstrip(": ")
        raise InvalidRequestError(f"{param}: {message}", param=param)
    spec = answer.get("spec")
    return so if spec is None else so.model_copy(update={"spec": spec})


def _write(stream: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)


async def _read(stream: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await stream.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes")
    message = json.loads(await stream.readexactly(size))
    if not isinstance(message, dict):
        raise ValueError("frame is not a JSON object")
    return message


# --- the child ---------------------------------------------------------------------------------


def _child_main() -> None:
    """The child's loop: the init frame, then one answer per request frame until stdin ends.
    Errors of a constraint are answers (``{"error": ...}``); anything else ends the child."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def read() -> dict[str, Any] | None:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack(header)
        message = json.loads(stdin.read(size))
        assert isinstance(message, dict)
        return message

    def write(message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        stdout.write(_HEADER.pack(len(data)) + data)
        stdout.flush()

    init = read()
    if init is None:
        return
    from llguidance import LLTokenizer

    try:
        tokenizer = LLTokenizer(
            init["tokenizer"], n_vocab=init["vocab_size"], eos_token=init["eos"] or None
        )
    except Exception as exc:  # a tokenizer llguidance cannot use: every check would fail
        write({"error": repr(exc)})
        return
    write({"ready": True})
    while (request := read()) is not None:
        write(_on_big_stack(lambda r=request: _compile(tokenizer, r)))


def _on_big_stack(work: Any) -> dict[str, Any]:
    """Run ``work()`` on a thread with :data:`CHECK_STACK_BYTES` of stack (whatever ``ulimit -s``
    says) and return its answer."""
    answer: dict[str, Any] = {}

    def run() -> None:
        answer.update(work())

    threading.stack_size(CHECK_STACK_BYTES)
    thread = threading.Thread(target=run, name="grammar-check")
    thread.start()
    thread.join()
    return answer


def _compile(tokenizer: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One check (:func:`pdserve.grammar.check` with the tokenizer): the normalized spec where it
    changed, or the client's error."""
    so = StructuredOutput(
        kind=request["kind"], spec=request["spec"], whitespace=request["whitespace"]
    )
    try:
        norm = check(so, request["param"], tokenizer)
    except InvalidRequestError as exc:
        return {"error": exc.message, "param": request["param"]}
    return {"spec": norm.spec} if norm.spec != so.spec else {}


if __name__ == "__main__":
    _child_main()
