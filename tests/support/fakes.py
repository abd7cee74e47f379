"""Fakes for router and server unit tests: a discovery watcher, scripted workers, a tiny
byte-level tokenizer, and helpers that serve apps over real uvicorn or in-process ASGI.

- :class:`FakeWatcher`: the router-side discovery interface over a plain dict.
- :class:`FakeWorker`: a FastAPI app implementing the worker request plane
  (``/internal/context``, ``/internal/release``, ``/internal/generate``) from a script: the
  reply tokens, optional errors, a per-token delay; it records every request it received and
  which decode streams were aborted (connection closed before the last chunk).
- :func:`build_tokenizer_dir`: a byte-level BPE tokenizer (256 byte tokens + 4 specials) with a
  ChatML-style chat template and a ``config.json``, saved to a folder (no model weights).
- :func:`serve_app`: run an ASGI app on a real uvicorn server on a free port.
- :func:`router_harness`: a router app + fake workers, in-process or over real sockets;
  :func:`short_worker_wait`: a config whose router waits a fraction of a second, not 30 s, for
  a worker before a failure reaches the client.
- The cluster secret of every test deployment: :data:`TEST_SECRET`, as settings
  (:data:`SECURITY`, for a ``RouterConfig`` / ``WorkerConfig``), as a key (:data:`CLUSTER_KEY`)
  and as the internal routes' header (:data:`INTERNAL_AUTH`). Fake workers require that header
  on ``/internal/*`` and :func:`record` signs with that key, as real workers do.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import SecretStr

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import SecuritySettings
from pdserve.discovery import EmbeddedRegistry
from pdserve.errors import PdserveError
from pdserve.http.error_responses import install_error_handlers
from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    ContextStarted,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    KVLayout,
    ReleaseRequest,
    Role,
    SamplingParams,
    TokenLogprob,
    TransferHandle,
    WorkerLoad,
    WorkerRecord,
)
from pdserve.security import ClusterKey
from tests.support.servers import bound_socket, uvicorn_started

if TYPE_CHECKING:
    from pdserve.router.router import Router

MODEL = "tiny-test"

TEST_SECRET = "pdserve-tests-cluster-secret-0123456789abcdef"
"""The cluster secret of every in-process test deployment (at least 32 characters)."""
SECURITY = SecuritySettings(cluster_secret=SecretStr(TEST_SECRET))
"""``security`` settings holding :data:`TEST_SECRET` (``RouterConfig(security=SECURITY)``)."""
CLUSTER_KEY = ClusterKey(TEST_SECRET.encode())
"""The key every test process derives from :data:`TEST_SECRET`."""
INTERNAL_AUTH = CLUSTER_KEY.http_headers()
"""``{"Authorization": "Bearer <token>"}``: what the registry and ``/internal/*`` routes need."""


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer_dir(path: Path, *, max_position_embeddings: int = 128) -> Path:
    """Save a byte-level tokenizer + chat template + ``config.json`` into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    config = {"model_type": "llama", "max_position_embeddings": max_position_embeddings}
    (path / "config.json").write_text(json.dumps(config))
    return path


def layout(
    *,
    tokens_per_block: int = 16,
    dtype: str = "float32",
    num_kv_heads: int = 2,
    num_layers: int = 2,
    head_dim: int = 8,
    model: str = MODEL,
) -> KVLayout:
    """The tiny KV layout of the tests (2 layers, 2 KV heads of 8, 16-token float32 blocks);
    every field can be overridden."""
    return KVLayout(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
        dtype=dtype,
    )


def registry_app(registry: EmbeddedRegistry) -> FastAPI:
    """A stand-in for the router's internal listener (its embedded registry): mounts
    ``registry`` (with the internal error handlers: a 401 is the JSON error body) and runs its
    sweep in the lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        yield
        await registry.close()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(registry.api_router())
    return app


def fake_handle(worker_id: str, req: ContextRequest, kv_layout: KVLayout) -> TransferHandle:
    """A transfer handle a fake prefill worker returns for ``req`` (epoch 7, block 0, a 30 s
    lease, a TCP endpoint nobody listens on)."""
    return TransferHandle(
        worker_id=worker_id,
        epoch=7,
        request_id=req.request_id,
        lease_id=f"lease-{req.request_id}",
        block_ids=(0,),
        num_tokens=len(req.prompt_token_ids),
        lease_deadline=time.time() + 30,
        layout=kv_layout,
        backend="tcp",
        transfer_endpoint="127.0.0.1:1",
    )


class FakeWatcher:
    """Discovery watcher over a dict; ``put``/``remove`` change what the router sees."""

    def __init__(self, records: list[WorkerRecord] | None = None) -> None:
        self._records = {r.worker_id: r for r in records or []}
        self.started = False
        self.closed = False
        self._subscribers: list[Any] = []

    def put(self, record: WorkerRecord) -> None:
        self._records[record.worker_id] = record
        for callback in self._subscribers:
            callback(record.worker_id, record)

    def remove(self, worker_id: str) -> None:
        if self._records.pop(worker_id, None) is not None:
            for callback in self._subscribers:
                callback(worker_id, None)

    async def start(self) -> None:
        self.started = True

    def workers(self) -> dict[str, WorkerRecord]:
        return dict(self._records)

    def subscribe(self, callback: Any) -> None:
        self._subscribers.append(callback)

    async def close(self) -> None:
        self.closed = True


def record(
    worker_id: str,
    role: Role | str,
    http_url: str = "",
    *,
    load: WorkerLoad | None = None,
    kv_layout: KVLayout | None = None,
    model: str = MODEL,
    protocol_version: int | None = None,
    epoch: int = 7,
) -> WorkerRecord:
    """A worker record of the test layout, signed with :data:`CLUSTER_KEY`; ``load`` defaults
    to 100 free of 100 blocks."""
    rec = WorkerRecord(
        role=Role(role),
        worker_id=worker_id,
        epoch=epoch,
        model=model,
        http_url=http_url or f"http://{worker_id}",
        layout=kv_layout or layout(),
        load=load or WorkerLoad(free_blocks=100, total_blocks=100),
    )
    if protocol_version is not None:
        rec = rec.model_copy(update={"protocol_version": protocol_version})
    return CLUSTER_KEY.sign_record(rec)


@dataclass
class FakeWorker:
    """A scripted prefill, decode or colocated worker. ``reply`` is the (token id, text)
    sequence every request gets, truncated to ``max_tokens``; the prefill side answers the
    first of them, a generation with a handle streams the rest, one without a handle (local
    prefill, colocated) streams all of them."""

    worker_id: str
    role: Role
    reply: list[tuple[int, str]]
    kv_layout: KVLayout = field(default_factory=layout)
    load: WorkerLoad = field(default_factory=lambda: WorkerLoad(free_blocks=100, total_blocks=100))
    error: PdserveError | None = None  # answered (status + envelope) instead of serving
    fail_after: int | None = None  # decode: an error chunk after this many streamed tokens
    token_delay_s: float = 0.0
    context_delay_s: float = 0.0
    cached_tokens: int = 0  # what its prefix cache "held" of every prompt it prefills
    streamed_error: PdserveError | None = None  # decode: answered to a streamed handle only
    handle_error: PdserveError | None = None  # decode: answered to a request with a handle
    http_url: str = ""
    cluster_key: ClusterKey = CLUSTER_KEY  # whose token /internal/* requires
    contexts: list[ContextRequest] = field(default_factory=list)
    generations: list[GenerationRequest] = field(default_factory=list)
    releases: list[ReleaseRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.http_url = self.http_url or f"http://{self.worker_id}"

    def record(self) -> WorkerRecord:
        return record(
            self.worker_id, self.role, self.http_url, load=self.load, kv_layout=self.kv_layout
        )

    def _logprob(self, token_id: int, sampling: SamplingParams) -> TokenLogprob | None:
        if not sampling.logprobs:
            return None
        top = ((token_id, -0.25), (0, -2.5))[: sampling.top_logprobs]
        return TokenLogprob(token_id=token_id, logprob=-0.25, top=top)

    def app(self) -> FastAPI:
        """The worker's request plane; every route needs ``cluster_key``'s bearer token (the
        router's :class:`WorkerClient` sends it), else 401."""

        def require_cluster_token(request: Request) -> None:
            if not self.cluster_key.check_http(request.headers.get("authorization")):
                raise HTTPException(401, "fake worker: missing or wrong cluster token")

        app = FastAPI(dependencies=[Depends(require_cluster_token)])

        @app.post("/internal/context")
        async def context(req: ContextRequest) -> Any:
            self.contexts.append(req)
            if self.context_delay_s:
                await asyncio.sleep(self.context_delay_s)
            if self.error is not None:
                return JSONResponse(self.error.to_json(), status_code=self.error.status)
            return self._context(req)

        @app.post("/internal/context/stream")
        async def context_stream(req: ContextRequest) -> Any:
            self.contexts.append(req)
            if self.error is not None:
                return JSONResponse(self.error.to_json(), status_code=self.error.status)
            handle = fake_handle(self.worker_id, req, self.kv_layout)
            handle = handle.model_copy(update={"block_ids": (), "streamed": True})
            started = ContextStarted(request_id=req.request_id, handle=handle)

            async def lines() -> AsyncIterator[bytes]:
                yield started.model_dump_json().encode() + b"\n"
                if self.context_delay_s:
                    await asyncio.sleep(self.context_delay_s)
                yield self._context(req).model_dump_json().encode() + b"\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        @app.post("/internal/release")
        async def release(req: ReleaseRequest) -> dict[str, bool]:
            self.releases.append(req)
            return {"released": True}

        @app.post("/internal/generate")
        async def generate(req: GenerationRequest) -> Any:
            self.generations.append(req)
            error = self.error
            if req.handle is not None and req.handle.streamed and self.streamed_error:
                error = self.streamed_error
            if req.handle is not None and self.handle_error is not None:
                error = self.handle_error
            if error is not None:
                return JSONResponse(error.to_json(), status_code=error.status)
            return StreamingResponse(self._stream(req), media_type="application/x-ndjson")

        return app

    def _context(self, req: ContextRequest) -> ContextResponse:
        """The prefill leg's answer (either context route)."""
        token, text = self.reply[0]
        finish = None
        if len(self.reply) == 1:
            finish = FinishReason.STOP
        elif req.sampling.max_tokens == 1:
            finish = FinishReason.LENGTH
        handle = None
        if finish is None:
            handle = fake_handle(self.worker_id, req, self.kv_layout)
        return ContextResponse(
            request_id=req.request_id,
            first_token=token,
            text=text,
            logprob=self._logprob(token, req.sampling),
            finish_reason=finish,
            handle=handle,
            cached_tokens=self.cached_tokens,
        )

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[bytes]:
        first = 0 if req.handle is None else 1  # no handle: this worker prefills, token 0 too
        if req.resume is not None:  # a migrated request (n = 1): after the tokens sent
            first = len(req.resume[0].token_ids)
        rest = self.reply[first : req.sampling.max_tokens]
        truncated = len(self.reply) > req.sampling.max_tokens
        done = False
        try:
            for i, (token, text) in enumerate(rest):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if self.fail_after is not None and i >= self.fail_after:
                    chunk = GenerationChunk(
                        request_id=req.request_id,
                        finish_reason=FinishReason.ERROR,
                        error="KV transfer from the prefill worker failed",
                    )
                    done = True
                    yield chunk.model_dump_json().encode() + b"\n"
                    return
                last = i == len(rest) - 1
                finish = None
                if last:
                    finish = FinishReason.LENGTH if truncated else FinishReason.STOP
                lp = self._logprob(token, req.sampling)
                chunk = GenerationChunk(
                    request_id=req.request_id,
                    token_ids=(token,),
                    text=text,
                    logprobs=(lp,) if lp else (),
                    finish_reason=finish,
                    cached_tokens=self.cached_tokens if first == 0 and i == 0 else None,
                )
                done = last
                yield chunk.model_dump_json().encode() + b"\n"
        finally:
            if not done:
                self.aborted.append(req.request_id)


@asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free port of 127.0.0.1 (lifespan included) in this
    event loop; yields the base URL and stops the server on exit."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1, access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await uvicorn_started(server, task)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@dataclass
class RouterHarness:
    """A running router app with fake workers. ``client`` talks to the router."""

    client: httpx.AsyncClient
    url: str
    watcher: FakeWatcher
    workers: dict[str, FakeWorker]


@asynccontextmanager
async def router_harness(
    cfg: RouterConfig, workers: list[FakeWorker], *, real_sockets: bool = False
) -> AsyncIterator[RouterHarness]:
    """Start fake ``workers`` and a router app for ``cfg`` that sees them.

    In-process (default): workers and router run on ``httpx.ASGITransport`` (no sockets;
    responses are buffered, so nothing streams incrementally). With ``real_sockets``: each app
    runs on its own uvicorn server, so streams, disconnects and aborts are real.

    Local prefill of short prompts (``router.local_prefill_max_tokens``) is off unless ``cfg``
    sets it explicitly: the fake workers' tests script the two legs of a prompt of any length.
    """
    from pdserve.security import ClusterKey
    from pdserve.server.app import create_app

    if "local_prefill_max_tokens" not in cfg.router.model_fields_set:
        two_legs = cfg.router.model_copy(update={"local_prefill_max_tokens": 0})
        cfg = cfg.model_copy(update={"router": two_legs})

    sec = cfg.security
    # The router derives its key from cfg.security; a cfg without a secret gets the tests'.
    injected = None if sec.cluster_secret or sec.cluster_secret_file else CLUSTER_KEY
    key = injected or ClusterKey.from_settings(sec)
    for w in workers:
        w.cluster_key = key
    async with AsyncExitStack() as stack:
        watcher = FakeWatcher()
        if real_sockets:
            for w in workers:
                w.http_url = await stack.enter_async_context(serve_app(w.app()))
            worker_http = httpx.AsyncClient(trust_env=False)
        else:
            mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in workers}
            worker_http = httpx.AsyncClient(mounts=mounts, trust_env=False)  # type: ignore[arg-type]
        await stack.enter_async_context(worker_http)
        for w in workers:
            watcher.put(w.record())
        app = create_app(cfg, watcher=watcher, http_client=worker_http, cluster_key=injected)
        if real_sockets:
            url = await stack.enter_async_context(serve_app(app))
            client = httpx.AsyncClient(base_url=url, trust_env=False, timeout=30)
        else:
            await stack.enter_async_context(app.router.lifespan_context(app))
            url = "http://router"
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                base_url=url,
                timeout=30,
            )
        await stack.enter_async_context(client)
        yield RouterHarness(client, url, watcher, {w.worker_id: w for w in workers})


SHORT_WORKER_WAIT_S = 0.2
"""A router's wait for a worker (``router.worker_wait_s``) in a test whose failure has no other
worker to go to: the wait is still taken, for a fraction of a second instead of the default 30."""


def short_worker_wait(cfg: RouterConfig, wait_s: float = SHORT_WORKER_WAIT_S) -> RouterConfig:
    """``cfg`` whose router holds a request ``wait_s`` for a worker (to route it, or to migrate
    a failed decode leg to) before answering the error."""
    router = cfg.router.model_copy(update={"worker_wait_s": wait_s})
    return cfg.model_copy(update={"router": router})


# --- a Router over scripted workers (the router's unit tests) -----------------------------------

REPLY = [(72, "H"), (105, "i"), (33, "!"), (10, "\n")]
"""The reply the scripted workers of :func:`make_router` give by default."""
PROMPT = [1, 2, 3]
"""A prompt's token ids for :class:`~pdserve.router.router.Router` tests."""


def prefill_worker(worker_id: str = "p0", **kw: Any) -> FakeWorker:
    """A scripted prefill worker replying :data:`REPLY` (``reply=`` overrides)."""
    return FakeWorker(worker_id, Role.PREFILL, kw.pop("reply", REPLY), **kw)


def decode_worker(worker_id: str = "d0", **kw: Any) -> FakeWorker:
    """A scripted decode worker replying :data:`REPLY` (``reply=`` overrides)."""
    return FakeWorker(worker_id, Role.DECODE, kw.pop("reply", REPLY), **kw)


@asynccontextmanager
async def make_router(
    *workers: FakeWorker,
    extra_records: Any = (),
    timeout_s: float = 10.0,
    kv_stream_min_tokens: int = 0,
    migration_limit: int = 3,
    worker_wait_s: float = 0.0,
    watcher: FakeWatcher | None = None,
) -> AsyncIterator[Router]:
    """A :class:`~pdserve.router.router.Router` (no HTTP app) over ``workers`` served
    in-process, plus ``extra_records`` in its discovery view; ``kv_stream_min_tokens``: the
    streamed hand-off's threshold (0: off); ``migration_limit`` and ``worker_wait_s`` as the
    router settings (no wait by default: a test of a failure gets it at once); ``watcher``:
    the discovery the router follows (the workers' and extra records are put in it)."""
    from pdserve.config.settings import RouterSettings
    from pdserve.router.client import WorkerClient
    from pdserve.router.router import Router
    from pdserve.router.router_metrics import RouterMetrics
    from pdserve.router.view import WorkerView

    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in workers}
    watcher = watcher if watcher is not None else FakeWatcher()
    for rec in [w.record() for w in workers] + list(extra_records):
        watcher.put(rec)
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as http:  # type: ignore[arg-type]
        view = WorkerView(watcher, served_model_name=MODEL)
        view.follow(watcher)
        client = WorkerClient(http, key=CLUSTER_KEY, connect_timeout_s=1.0)
        settings = RouterSettings(
            request_timeout_s=timeout_s,
            local_prefill_max_tokens=0,
            kv_stream_min_tokens=kv_stream_min_tokens,
            migration_limit=migration_limit,
            worker_wait_s=worker_wait_s,
        )
        yield Router(view, client, settings, metrics=RouterMetrics())
