"""The router process's HTTP app: OpenAI-compatible API in front of the router (two legs
through a prefill and a decode worker, or one leg on a decode or colocated worker).

Lifecycle (the lifespan)::

    1 START  load the tokenizer (local files only), work out the context window and start the
             tokenizer pool (:mod:`.tokenizer_pool`); start the embedded registry (if this app created it) and the discovery watcher (if this app
             opened it); open the client of the worker request plane (if not injected)
    2 SERVE  /v1/chat/completions, /v1/completions, /v1/responses (:mod:`.responses`),
             /v1/models, /tokenize, /detokenize, /health, /ready, /metrics; the embedded
             registry's /registry/* is a second app (:func:`create_apps`), served on the
             internal listener (``router.registry_port``), never on the public port
    3 STOP   close what step 1 opened, in reverse order; injected objects are left alone

Request path: the client API key and the body limit on ``/v1`` (:mod:`.guard`, before the body
is read), JSON parsing and schema validation (on the loop: linear, milliseconds for the largest
body), validate + chat template + tokenize (:mod:`pdserve.server.chat.preprocess`) on the tokenizer
pool's threads, never on the event loop (a full pool: 429 ``tokenizer_busy``), route it and run up to its
first token (``Router.start``: the prefill leg, or a one-leg stream's start; its failure is an
HTTP error status), then relay the rest as one JSON body or as SSE (a failure after the first byte is an in-band error event, :mod:`.sse`). A
request for ``n`` choices is one transaction whose events name their choice; the renderer
(:mod:`.output`) sorts them into the ``n`` choices. A completion of several prompts runs one
transaction per prompt, merged (:mod:`.batch`).

The OpenAPI document declares every status each route returns and, with API keys, the bearer
scheme on ``/v1`` (:mod:`.openapi`).

All state lives in :class:`ServerState` on ``app.state.pdserve``, created by the lifespan; the
module holds none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.config.loading import RouterConfig
from pdserve.errors import ClientDisconnectedError, PdserveError
from pdserve.http.error_responses import install_error_handlers, internal_error, log_failure
from pdserve.http.keepalive import ROUTER_KEEPALIVE_S
from pdserve.observability.prometheus import CONTENT_TYPE
from pdserve.observability.tracing import Timeline
from pdserve.router.admission import fair_queue
from pdserve.router.client import WorkerClient
from pdserve.router.kv_index import follow_kv_events
from pdserve.router.router import Router
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.sessions import SESSION_HEADER, session_id_from
from pdserve.router.view import WorkerSource, WorkerView
from pdserve.security import APIKeys, ClusterKey, Tenant
from pdserve.server.chat.batch import BatchTransaction, Started
from pdserve.server.chat.grammar_checker import GrammarChecker, checked
from pdserve.server.chat.preprocess import Prepared, Preprocessor, context_window, load_tokenizer
from pdserve.server.chat.sampling_defaults import SamplingDefaults
from pdserve.server.chat.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.server.chat.tokenizer_pool import TokenizerPool, backlog_bytes
from pdserve.server.guard import PublicPlaneGuard, log_auth_mode
from pdserve.server.openapi import (
    completion_responses,
    install_openapi,
    tokenizer_responses,
    v1_errors,
)
from pdserve.server.rendering.chunks import ChatRenderer, CompletionRenderer, RequestInfo
from pdserve.server.rendering.logprobs import TokenRenderer
from pdserve.server.rendering.replies import (
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    Readiness,
)
from pdserve.server.rendering.sse import DONE, SSEResponse, encode_error, encode_event
from pdserve.server.responses.routes import add_responses_routes
from pdserve.server.timelines import (
    DISCONNECT_POLL_S,
    closer,
    collecting,
    received_ns,
    request_timeline,
    started,
    unless_disconnected,
)

log = logging.getLogger(__name__)


ResponseRenderer: TypeAlias = ChatRenderer | CompletionRenderer


@dataclass
class ServerState:
    """Everything a request handler needs, built by the lifespan."""

    cfg: RouterConfig
    preprocessor: Preprocessor
    tokenizer_pool: TokenizerPool
    grammars: GrammarChecker
    tokens: TokenRenderer
    view: WorkerView
    router: Router
    max_model_len: int
    started_at: int
    metrics: RouterMetrics


@dataclass(frozen=True)
class RouterApps:
    """The router process's two ASGI apps: ``public`` (the OpenAI API and the probes, on
    ``router.port``; its lifespan starts and stops everything) and ``registry`` (the embedded
    registry's ``/registry/*`` routes, on the internal listener ``router.registry_port``; no
    lifespan of its own; None without an embedded registry)."""

    public: FastAPI
    registry: FastAPI | None


def create_app(
    cfg: RouterConfig,
    *,
    watcher: Any | None = None,
    registry: Any | None = None,
    http_client: httpx.AsyncClient | None = None,
    cluster_key: ClusterKey | None = None,
) -> FastAPI:
    """The public app of :func:`create_apps` (same arguments): with an embedded registry, the
    registry's routes are not on it (they are on :attr:`RouterApps.registry`)."""
    return create_apps(
        cfg, watcher=watcher, registry=registry, http_client=http_client, cluster_key=cluster_key
    ).public


def create_registry_app(registry: Any) -> FastAPI:
    """The internal listener's app: ``registry.api_router()`` (``/registry/*``: the cluster
    token on every route) with the internal error handlers, no OpenAPI document and no
    lifespan (the public app's lifespan starts and closes the registry it owns)."""
    app = FastAPI(title="pdserve registry", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app, public=False)
    app.include_router(registry.api_router())
    return app


def create_apps(
    cfg: RouterConfig,
    *,
    watcher: Any | None = None,
    registry: Any | None = None,
    http_client: httpx.AsyncClient | None = None,
    cluster_key: ClusterKey | None = None,
) -> RouterApps:
    """Build the router apps for ``cfg`` (:class:`RouterApps`).

    - ``watcher``: discovery watcher (``workers() -> dict[str, WorkerRecord]``; ``start()`` and
      ``close()`` are called only on a watcher this app opens itself with
      ``pdserve.discovery.open_watcher(cfg.discovery.url, registry=registry, key=...)``).
    - ``registry``: an embedded registry to serve (``api_router()`` under ``/registry``, on
      :attr:`RouterApps.registry`). When neither ``watcher`` nor ``registry`` is given and
      ``cfg.discovery.url == "embedded"``, the public app's lifespan creates an
      ``EmbeddedRegistry`` (its routes internal: bearer token, no OpenAPI document) and
      starts/closes it.
    - ``http_client``: an httpx client for the worker request plane (tests); else the lifespan
      opens and closes the one ``router.worker_client`` names (:mod:`pdserve.http.plane_client`).
    - ``cluster_key``: the internal plane's key (registry routes, worker calls, record
      signatures); default ``ClusterKey.from_settings(cfg.security)``, which raises
      :class:`~pdserve.errors.ConfigError` when no cluster secret is configured.

    Injected objects are used as they are: the caller starts and closes them.
    """
    key = cluster_key or ClusterKey.from_settings(cfg.security)  # ConfigError: no secret
    owned_registry = registry is None and watcher is None and cfg.discovery.url == "embedded"
    if owned_registry:
        from pdserve.discovery import EmbeddedRegistry

        store = None
        if cfg.router.registry_store:
            from pdserve.discovery.registry_store import RegistryStore

            store = RegistryStore(cfg.router.registry_store)
        registry = EmbeddedRegistry(ttl_s=cfg.discovery.registration_ttl_s, key=key, store=store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app.state.pdserve = await _start(
                cfg, stack, watcher, registry, owned_registry, http_client, key, api_keys
            )
            log.info(
                "router%s serving %s (context window %d tokens, discovery %s)",
                f" {cfg.router.name}" if cfg.router.name else "",
                cfg.served_model_name,
                app.state.pdserve.max_model_len,
                cfg.discovery.url,
            )
            log_auth_mode(api_keys, cfg.router.host)
            try:
                yield
            finally:
                del app.state.pdserve
        log.info("router stopped")

    api_keys = APIKeys.from_settings(cfg.security)  # ConfigError: unreadable key file
    app = FastAPI(title="pdserve", lifespan=lifespan)
    install_error_handlers(app, public=True)  # no worker id or address reaches a client
    app.add_middleware(
        PublicPlaneGuard, api_keys=api_keys, max_body_bytes=cfg.router.max_request_bytes
    )
    install_openapi(app, secured=api_keys.enabled)
    _add_routes(app, secured=api_keys.enabled)
    add_responses_routes(app, secured=api_keys.enabled, collect=_collect)
    return RouterApps(app, create_registry_app(registry) if registry is not None else None)


async def _start(
    cfg: RouterConfig,
    stack: AsyncExitStack,
    watcher: Any | None,
    registry: Any | None,
    owned_registry: bool,
    http_client: httpx.AsyncClient | None,
    key: ClusterKey,
    api_keys: APIKeys,
) -> ServerState:
    """Lifespan step 1. Everything opened here is pushed onto ``stack`` for step 3."""
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model_path)
    max_model_len = context_window(cfg, tokenizer)
    tokenizer_pool = TokenizerPool(
        cfg.router.tokenizer_threads,
        max_backlog_bytes=backlog_bytes(cfg.router.max_request_bytes),
    )
    stack.callback(tokenizer_pool.close)
    grammars = GrammarChecker(tokenizer, len(tokenizer), _eos_ids(tokenizer))
    stack.push_async_callback(grammars.close)
    if owned_registry:
        assert registry is not None
        await registry.start()
        stack.push_async_callback(registry.close)
    if watcher is None:
        from pdserve.discovery import open_watcher

        watcher = open_watcher(
            cfg.discovery.url, registry=registry, key=key, discovery=cfg.discovery
        )
        await watcher.start()
        stack.push_async_callback(watcher.close)
    if http_client is None and cfg.router.worker_client == "httpx":
        http_client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.router.request_timeout_s, connect=5.0),
            limits=httpx.Limits(
                max_connections=1024,
                max_keepalive_connections=128,
                keepalive_expiry=ROUTER_KEEPALIVE_S,  # < the workers' keep-alive
            ),
            trust_env=False,  # the request plane never goes through an HTTP proxy
        )
        stack.push_async_callback(http_client.aclose)
    worker_client = WorkerClient(http_client, key=key)  # None: its own lean client (wire)
    stack.push_async_callback(worker_client.aclose)  # closes only what it opened
    source: WorkerSource = watcher

    def usable_workers() -> dict[str, int]:
        c = view.candidates()
        return {"prefill": len(c.prefill), "decode": len(c.decode), "colocated": len(c.colocated)}

    sampling_defaults = SamplingDefaults.from_model(cfg.model_path, cfg.model.generation_config)
    log.info("%s", sampling_defaults.describe())
    kv_index = follow_kv_events(watcher)
    metrics = RouterMetrics(usable_workers, kv_index.stats if kv_index is not None else None)
    view = WorkerView(
        source,
        served_model_name=cfg.served_model_name,
        on_restart=lambda r: metrics.worker_restarts.labels(r.role.value).inc(),
    )
    view.follow(watcher)  # pdserve_worker_restarts_total{role}
    admission = fair_queue(cfg.router, api_keys, view, metrics)
    if admission is not None:
        stack.push_async_callback(admission.close)
    return ServerState(
        cfg=cfg,
        preprocessor=Preprocessor(
            tokenizer,
            served_model_name=cfg.served_model_name,
            max_model_len=max_model_len,
            max_n=cfg.router.max_n,
            max_messages=cfg.router.max_messages,
            tool_call_parser=cfg.router.tool_call_parser,
            special_tokens_in_content=cfg.router.special_tokens_in_content,
            sampling_defaults=sampling_defaults,
        ),
        tokenizer_pool=tokenizer_pool,
        grammars=grammars,
        tokens=TokenRenderer(tokenizer),
        view=view,
        router=Router(
            view, worker_client, cfg.router, metrics=metrics, kv_index=kv_index, admission=admission
        ),
        max_model_len=max_model_len,
        started_at=int(time.time()),
        metrics=metrics,
    )


def _state(request: Request) -> ServerState:
    return request.app.state.pdserve  # type: ignore[no-any-return]


def _add_routes(app: FastAPI, *, secured: bool) -> None:
    """The probes (open) and the ``/v1`` routes; ``responses`` declares every status a route
    returns (:mod:`.openapi`)."""

    @app.get("/health", response_model=Health)
    async def health() -> dict[str, str]:
        """200 while the process serves HTTP (no API key needed)."""
        return {"status": "ok"}

    @app.get(
        "/ready",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "not ready; missing says why"}},
    )
    async def ready(request: Request) -> JSONResponse:
        """200 when some path serves the model (a prefill + decode pair, a decode worker that
        prefills locally, or a colocated worker), else 503 + missing (no API key needed)."""
        st = _state(request)
        r = st.view.readiness()
        body: dict[str, Any] = {
            "status": "ready" if r.ready else "not_ready",
            "model": st.cfg.served_model_name,
            "prefill": list(r.prefill),
            "decode": list(r.decode),
            "colocated": list(r.colocated),
            "paths": list(r.paths),
        }
        if not r.ready:
            body["missing"] = list(r.missing)
        if r.notes:
            body["notes"] = list(r.notes)
        return JSONResponse(body, status_code=200 if r.ready else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        """Prometheus text format: request outcomes, TTFT, TPOT, ITL, tokens, workers (no API
        key needed)."""
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=v1_errors(secured=secured))
    async def models(request: Request) -> dict[str, Any]:
        """The served model (one card)."""
        st = _state(request)
        card = ModelCard(
            id=st.cfg.served_model_name, created=st.started_at, max_model_len=st.max_model_len
        )
        return ModelList(data=[card]).model_dump(mode="json")

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=completion_responses(ChatCompletionResponse, secured=secured),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completion, streamed (SSE) or not."""
        t0 = received_ns(request)
        st = _state(request)
        session = session_id_from(request.headers.get(SESSION_HEADER), body.user,
                                  from_user=st.cfg.router.session_from_user)  # fmt: skip
        place = (getattr(request.state, "tenant", None), body.priority)
        prepared = await st.tokenizer_pool.run(
            await _body_size(request), st.preprocessor.chat, body
        )
        (prepared,) = await checked(st.grammars, [prepared])
        info = _info(f"chatcmpl-{uuid.uuid4().hex}", st, prepared, bool(body.logprobs), body)
        fmt = ChatRenderer(info, st.tokens, prepared.tools)
        return await _serve(request, st, prepared, fmt, stream=bool(body.stream), start_ns=t0,
                            session=session, place=place)  # fmt: skip

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=completion_responses(CompletionResponse, secured=secured),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completion, streamed (SSE) or not."""
        t0 = received_ns(request)
        st = _state(request)
        session = session_id_from(request.headers.get(SESSION_HEADER), body.user,
                                  from_user=st.cfg.router.session_from_user)  # fmt: skip
        place = (getattr(request.state, "tenant", None), body.priority)
        prep = st.preprocessor  # token ids alone are checked here (linear), text on the pool
        batch = (await st.tokenizer_pool.run(await _body_size(request), prep.completions, body)
                 if prep.needs_tokenizer(body) else prep.completions(body))  # fmt: skip
        batch = await checked(st.grammars, batch)
        info = _info(f"cmpl-{uuid.uuid4().hex}", st, batch[0], body.logprobs is not None, body)
        info.n, info.prompts = info.n * len(batch), len(batch)
        info.prompt_tokens = sum(len(p.prompt_token_ids) for p in batch)
        echo = [p.echo or "" for p in batch for _ in range(p.sampling.n)] if body.echo else None
        wanted = batch[0].sampling.prompt_logprobs is not None
        prompts = [list(p.prompt_token_ids) for p in batch] if wanted else None
        fmt = CompletionRenderer(
            info, st.tokens, echo, prompts, prompt_logprobs=body.prompt_logprobs is not None
        )
        return await _serve(request, st, batch, fmt, stream=bool(body.stream), start_ns=t0,
                            session=session, place=place)  # fmt: skip

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=tokenizer_responses(TokenizeResponse, secured=secured),
    )
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's tokenizer route: a prompt's (or chat messages') token ids and their count."""
        st = _state(request)
        ids = await st.tokenizer_pool.run(await _body_size(request), st.preprocessor.tokenize, body)
        strs = [st.tokens.text(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": st.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=tokenizer_responses(DetokenizeResponse, secured=secured),
    )
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        """vLLM's detokenizer route: token ids back to text."""
        st = _state(request)
        text = await st.tokenizer_pool.run(
            await _body_size(request), st.preprocessor.detokenize, body
        )
        return {"prompt": text}


def _eos_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS id, as a list (empty when it names none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


async def _body_size(request: Request) -> int:
    """The request body's size in bytes (FastAPI has read and cached it to parse it): what the
    tokenizer pool counts this request's work by."""
    return len(await request.body())


def _info(
    response_id: str,
    st: ServerState,
    prepared: Prepared,
    logprobs: bool,
    body: ChatCompletionRequest | CompletionRequest,
) -> RequestInfo:
    return RequestInfo(
        response_id=response_id,
        model=st.cfg.served_model_name,
        prompt_tokens=len(prepared.prompt_token_ids),
        logprobs=logprobs,
        n=prepared.sampling.n,
        include_usage=bool(
            body.stream and body.stream_options and body.stream_options.include_usage
        ),
    )


async def _serve(
    request: Request,
    st: ServerState,
    prepared: Prepared | list[Prepared],
    fmt: ResponseRenderer,
    *,
    stream: bool,
    start_ns: int,
    session: str | None = None,
    place: tuple[Tenant | None, int] = (None, 0),
) -> Response:
    """Run the transaction (a list of several prompts: one per prompt, as one
    :class:`~pdserve.server.chat.batch.BatchTransaction`); errors before the first byte raise (->
    HTTP status). The request's timeline (:mod:`.timelines`) began at ``start_ns`` and ends
    with the response. ``session``: the session id of a single prompt (session affinity);
    ``place``: its tenant and priority in the router's fair queue."""
    request_id = fmt.info.response_id
    batch = prepared if isinstance(prepared, list) else [prepared]
    operation = "chat" if isinstance(fmt, ChatRenderer) else "text_completion"
    timeline = request_timeline(
        request,
        operation,
        st.cfg.served_model_name,
        request_id,
        fmt.info.prompt_tokens,
        batch[0].sampling,
        start_ns,
    )
    phase_log = st.cfg.observability.phase_log
    log.debug(
        "req %s: %s prompt tokens, %s, stream=%s",
        request_id,
        "+".join(str(len(p.prompt_token_ids)) for p in batch),
        batch[0].sampling,
        stream,
    )
    start: Coroutine[Any, Any, Started]
    if len(batch) == 1:
        p = batch[0]
        ids = p.prompt_token_ids
        start = st.router.start(request_id, ids, p.sampling, timeline, session, *place)
    else:
        pairs = [(p.prompt_token_ids, p.sampling) for p in batch]
        start = BatchTransaction.start(st.router, request_id, pairs, timeline, *place)
    txn: Started = await started(
        unless_disconnected(request, start), timeline, request_id, phase_log=phase_log
    )
    if stream:
        on_close = closer(txn.aclose, timeline, request_id, phase_log=phase_log)
        return SSEResponse(
            _sse(txn, fmt, timeline), headers={"x-request-id": request_id}, on_close=on_close
        )
    async with collecting(txn.aclose, timeline, request_id, phase_log=phase_log):
        await _collect(request, txn, fmt)
        response = JSONResponse(fmt.response(), headers={"x-request-id": request_id})
    return response


async def _collect(request: Request, txn: Started, fmt: ResponseRenderer) -> None:
    """Feed every event to ``fmt``. A client that disconnects (checked every
    ``DISCONNECT_POLL_S``) abandons the transaction, so the workers stop generating for nobody."""

    async def consume() -> None:
        async with aclosing(txn.events()) as events:
            async for event in events:
                fmt.add(event)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                log.info("req %s: client disconnected; abandoning it", txn.request_id)
                raise ClientDisconnectedError(f"client of {txn.request_id} disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    task.result()  # raises the transaction's typed error, if any


async def _sse(txn: Started, fmt: ResponseRenderer, timeline: Timeline) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the usage chunk if asked, ``[DONE]``; a failure becomes an error
    event followed by ``[DONE]`` (and the timeline's error). The transaction is closed however
    this ends."""
    held: list[bytes] = []  # events rendered, not yet written (the chunks read together)
    try:
        for start in fmt.start():
            yield encode_event(start)
        async with aclosing(txn.events()) as events:
            async for event in events:
                held.extend(encode_event(chunk) for chunk in fmt.chunks(event))
                if not txn.ready():  # nothing more at hand: one write for what is held
                    yield b"".join(held)
                    held.clear()
        if fmt.info.include_usage:
            held.append(encode_event(fmt.usage_chunk()))
    except PdserveError as exc:
        timeline.fail(repr(exc))
        log_failure(txn.request_id, exc, public=True, what="failed mid-stream")
        held.append(encode_error(exc, txn.request_id, public=True))
    except Exception as exc:
        timeline.fail(repr(exc))
        log.exception("req %s: unexpected error mid-stream", txn.request_id)
        held.append(encode_error(internal_error(txn.request_id), txn.request_id, public=True))
    finally:
        await txn.aclose()
    yield b"".join(held) + DONE
