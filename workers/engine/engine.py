"""Engine: one model, one KV block pool, a continuous-batching step loop on its own thread.

Request lifecycle (the numbered states of :class:`SequenceStatus`; the queues are named after
them)::

    1. RESERVED  resume only: reserve() allocated the prompt's blocks (optionally starting with
                 its cached prefix), which the caller fills (KV transfer). queue: scheduler.reserved
    2. WAITING   add_request() validated it; waits for admission (KV blocks for what it must
                 compute now, or for its whole completion under guaranteed_no_evict; a running
                 slot); a preempted sequence comes back here.         queue: scheduler.waiting
    3. PREFILL   admitted; the prompt's K/V is computed, in chunks (after a preemption: the
                 prompt's and the already produced tokens').          queue: scheduler.running
    4. DECODE    one token per step.                                  queue: scheduler.running
    5. PARKED    prefill mode only: its one token went out; the prompt's blocks belong to the
                 caller until free_parked().                          queue: Engine.parked
    6. FINISHED  the last output (finish_reason set) went to the sink; blocks freed.

    full: 2 -> 3 -> 4 -> 6     prefill: 2 -> 3 -> 5 (or 6)     resume: 1 -> 2 -> 4 -> 6
    preemption (max_utilization): 3 or 4 -> 2, blocks freed, recomputed when readmitted
    migration (full mode with ``EngineRequest.resume``, :mod:`.migration`): each choice listed
    enters 2 as a preempted one (prompt + its tokens so far recomputed), 2 -> 3 -> 4 -> 6
    abort(): 1..5 -> 6 (the sink gets finish_reason ABORT in 2..4)

Choices (``n > 1``, vLLM's parallel sampling): choice 0 runs as above; choices ``1..n-1`` are
forked from it once its prompt's K/V exists (mode ``full``: after its first token, unless
migrated; mode ``resume``: at once, from the transferred blocks). A fork shares the prompt's
full blocks (reference counted, :meth:`KVCacheManager.fork`), copies the block holding the last
prompt token, and recomputes only that token to sample its own first token (seed ``seed + i``).
Mode ``prefill`` samples choice 0 only, and with ``n > 1`` parks the blocks even when that token
ended choice 0, since the decode worker's other choices still need them.

Prefix cache (``kv_cache.prefix_caching``, :mod:`pdserve.workers.kv.manager`): every full block
a forward completes is registered under its chained hash after the step (resume: the
transferred prompt's full blocks, when the resume request arrives); an admitted sequence starts
at its longest cached prefix, in every mode. KV cache connector (``kv_cache.host_cache_mb``,
``disk_cache_dir``; :mod:`pdserve.workers.kv.offload`): blocks after that prefix found in the
host or disk tier are loaded before the admitting step's forward; completed blocks are queued
for the disk tier after each step; :meth:`Engine.shutdown` writes what is queued.

Each step (nano-vllm's ``LLMEngine.step``): the scheduler picks the running decode sequences and
prefill chunks and allocates their blocks (preempting if short), the runner runs one forward
(a chunk asking for prompt logprobs keeps every position's logits), the sampler picks a token per
sequence at its last known token, and the engine appends it, checks the stop conditions, emits
an :class:`EngineOutput` and frees, parks or keeps the sequence. A failing step ends its
sequences with an error output and frees their blocks; the loop carries on.

Thread-safety: every public method may be called from any thread. Sinks run on the engine thread
(a choice already finished when added, resumed or migrated: on the caller's) and must not
block. Aborts are applied by the engine thread between steps, so blocks are never freed under a
running forward.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.config.loading import EngineConfig
from pdserve.errors import InvalidRequestError, QueueFullError
from pdserve.protocol import FinishReason, SamplingParams, TokenLogprob, WorkerLoad
from pdserve.workers.engine.model.model_runner import ModelRunner, kept_rows
from pdserve.workers.engine.model.served_model import (
    context_window,
    eos_token_ids,
    kv_layout,
    kv_pool,
)
from pdserve.workers.engine.omp import context_thread, in_fresh_thread
from pdserve.workers.engine.requests import (
    EngineOutput,
    EngineRequest,
    LiveSequence,
    RequestLimits,
    Reservation,
    Sink,
    choice_id,
    choice_sampling,
    progress_output,
)
from pdserve.workers.engine.resume import replay_stop, resumed_choices
from pdserve.workers.engine.sampling.grammar_masks import (
    GRAMMAR_STACK_BYTES,
    GrammarCompiler,
    GrammarError,
    GrammarState,
)
from pdserve.workers.engine.sampling.sampler import Sampler, record_prompt_logprobs
from pdserve.workers.engine.sampling.speculative import SpecDecodeStats
from pdserve.workers.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.workers.engine.sequence import IncrementalDetokenizer, Sequence, SequenceStatus
from pdserve.workers.kv.offload import KVConnectorStats, build_connector

__all__ = ["Engine", "EngineOutput", "EngineRequest", "Sink"]

log = logging.getLogger(__name__)


class Engine:
    """The engine of ``docs/architecture/workers.md``. Loads model and tokenizer, allocates the pool.

    Attributes: ``layout`` (:class:`KVLayout`, ``model`` = served name + config digest),
    ``tokenizer``, ``kv_cache`` (:class:`KVCacheManager`, ``.pool`` is the tensor),
    ``max_model_len``, ``eos_token_ids``, ``parked`` (request id -> block ids).
    Raises :class:`ConfigError` for an unusable model folder or ``max_model_len``, or a KV
    budget that holds no block. The construction runs on a short-lived thread
    (:mod:`pdserve.workers.engine.omp`: the step thread then owns the process's only OpenMP
    team).
    """

    def __init__(self, cfg: EngineConfig):
        in_fresh_thread(lambda: self._setup(cfg))

    def _setup(self, cfg: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        path = Path(cfg.model_path)
        self.runner = ModelRunner(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.max_model_len: int = context_window(cfg, self.runner)
        self.eos_token_ids: frozenset[int] = eos_token_ids(self.runner, self.tokenizer)
        self.layout = kv_layout(cfg, self.runner)
        self.kv_cache = kv_pool(cfg, self.runner, self.layout, self.max_model_len)
        self.connector = build_connector(cfg.kv_cache, self.kv_cache)  # None: no tier
        self.scheduler = Scheduler(
            self.kv_cache,
            cfg.scheduler,
            connector=self.connector.scheduler if self.connector else None,
        )
        self.limits = RequestLimits(
            self.runner.vocab_size, self.max_model_len, self.kv_cache, cfg.scheduler.capacity_policy
        )
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.spec = SpecDecodeStats()
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids)
        )
        self.parked: dict[str, list[int]] = {}
        self._live: dict[str, LiveSequence] = {}  # sequence id -> live sequence
        self._groups: dict[str, list[str]] = {}  # request id -> its live sequence ids
        self._aborts: set[str] = set()
        self._lock = threading.RLock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._shut_down = False

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (once), in a copy of the caller's context."""
        with self._lock:
            if self._thread is None and not self._shut_down:
                self._thread = context_thread(
                    self._loop, "pdserve-engine", stack_bytes=GRAMMAR_STACK_BYTES
                )  # the step computes grammar masks

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the step thread (waits up to ``timeout`` s for the current step), end every
        live request with ABORT and free all blocks. Idempotent."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            thread = self._thread
        self._stopping.set()
        self._wakeup.set()
        self.grammars.close()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("engine thread did not stop within %.1f s", timeout)
                return
        self._drain()
        self.runner.close()  # the other tensor parallel ranks, if any
        if self.connector is not None:
            self.connector.shutdown()  # writes the queued disk tier saves

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, sink: Sink) -> None:
        """Queue ``req``; its outputs go to ``sink`` (on the engine thread), one per step and
        choice (``EngineOutput.index``). Raises :class:`InvalidRequestError` (bad tokens, too
        long for ``max_model_len``, duplicate id, resume without :meth:`reserve`, engine shut
        down), :class:`QueueFullError` (``max_queued_requests`` waiting already) or
        :class:`CapacityError` (can never fit the pool). A refused ``resume`` request frees its
        reservation. ``req.resume``: a migrated request (:mod:`.migration`)."""
        prompt = list(req.prompt_token_ids)
        rid, resume = req.request_id, req.resume
        try:
            self.limits.check(rid, prompt, req.sampling, req.mode, req.first_token, resume)
            replay = (req.first_token,) if req.first_token is not None else ()
            grammar = self._grammar(req.sampling, replay)
            if resume is not None:  # built off the lock: replays the grammar and detokenizer
                migrated = resumed_choices(req, self.limits, self.tokenizer, self._grammar, sink)
            with self._lock:
                if self._shut_down:
                    raise InvalidRequestError("the engine is shut down")
                if req.request_id in self._groups or req.request_id in self.parked:
                    raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
                waiting = len(self.scheduler.waiting)
                if req.mode != "resume" and waiting >= self.cfg.scheduler.max_queued_requests:
                    raise QueueFullError(
                        f"{waiting} requests are waiting on this worker (max_queued_requests); "
                        "retry later"
                    )
                if resume is not None:
                    self._start_migrated(rid, migrated)
                    self._wakeup.set()
                    return
                detok = IncrementalDetokenizer(self.tokenizer, req.sampling.stop)
                if req.mode == "resume":
                    seq = self._resume_from_reservation(req, prompt, detok)
                else:
                    need = self.limits.need_blocks(req)
                    seq = Sequence(rid, prompt, req.sampling, req.mode, need)
                fork = req.mode == "full" and req.sampling.n > 1
                live = LiveSequence(seq, sink, detok, grammar, progress=req.progress, fork=fork)
                self._live[seq.request_id] = live  # the engine sees it next step
                self._groups[req.request_id] = [seq.request_id]
                try:
                    if req.mode == "resume":
                        self._start_resumed(seq)
                    else:
                        self.scheduler.add(seq)
                except Exception:
                    for sid in self._groups.pop(req.request_id, []):
                        self._live.pop(sid, None)
                        if sid != seq.request_id:  # a forked choice: holds shared blocks
                            self.scheduler.remove(sid)
                    raise
        except Exception:
            if req.mode == "resume":  # a refused resume gives its reservation back
                self.unreserve(req.request_id)
            raise
        self._wakeup.set()

    def prepare_grammar(self, sampling: SamplingParams) -> None:
        """Compile ``sampling.structured`` (if any) into the grammar cache, so queueing the
        request does not (:mod:`.grammar`, step 1). Call off the event loop; raises
        InvalidRequestError when it does not compile."""
        if sampling.structured is not None:
            self.grammars.prepare(sampling.structured)

    def _grammar(
        self, sampling: SamplingParams, replay: tuple[int, ...] = ()
    ) -> GrammarState | None:
        so = sampling.structured
        return None if so is None else self.grammars.state(so, replay)

    def _resume_from_reservation(
        self, req: EngineRequest, prompt: list[int], detok: IncrementalDetokenizer
    ) -> Sequence:
        seq = self.scheduler.reserved.get(req.request_id)
        if seq is None:
            raise InvalidRequestError(f"resume of {req.request_id!r} without reserve()")
        if seq.prompt_token_ids != prompt or self.limits.need_blocks(req) > seq.need_blocks:
            raise InvalidRequestError(f"resume of {req.request_id!r} differs from its reserve()")
        assert req.first_token is not None
        seq.sampling = req.sampling
        seq.output_token_ids = [req.first_token]
        seq.num_computed_tokens = len(prompt)
        # The transfer filled the prompt's blocks: its full blocks join the prefix cache.
        self.kv_cache.register(seq.request_id, self.kv_cache.hasher.extend(seq), len(prompt), seq)
        # Replay what the prefill leg emitted for the first token so deltas continue from it.
        detok.append(req.first_token)
        detok.delta()
        return seq

    def _start_resumed(self, seq: Sequence) -> None:
        """Queue a resumed choice 0 and fork its siblings from the transferred blocks. A
        choice 0 that its first token already finished (``n > 1`` only: the prefill leg parked
        anyway) ends at once with an empty final output; its siblings keep the shared blocks.
        Lock held."""
        live = self._live[seq.request_id]
        self._fork_choices(seq, live.sink)
        reason = self.limits.stop_reason(live, seq.output_token_ids[0], self.eos_token_ids)
        if reason is None:
            self.scheduler.add(seq)
            return
        self.scheduler.unreserve(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        self._forget(seq)
        self._emit(live.sink, EngineOutput(seq.group_id, [], "", [], reason, index=0))

    def _start_migrated(self, request_id: str, choices: list[LiveSequence]) -> None:
        """Register a migrated request's choices and queue them (no fork: all are listed). A
        choice its replayed tokens already ended (should not happen) ends at once with a final
        output without tokens (the text it still held back, if any). Lock held."""
        self._groups[request_id] = [live.seq.request_id for live in choices]
        for live in choices:
            self._live[live.seq.request_id] = live
        for live in choices:
            seq, reason = live.seq, replay_stop(live, self.limits, self.eos_token_ids)
            if reason is None:
                self.scheduler.add(seq)
                continue
            seq.status = SequenceStatus.FINISHED
            self._forget(seq)
            text = live.detok.delta(final=True)
            self._emit(live.sink, EngineOutput(request_id, [], text, [], reason, index=seq.index))

    def _fork_choices(self, parent: Sequence, sink: Sink) -> None:
        """Add choices ``1..n-1`` of ``parent``'s request (``parent`` is choice 0 and holds its
        prompt's K/V), sharing its prompt blocks (see the module docstring). A choice that
        finds no free block for its copy recomputes its prompt when admitted. Lock held."""
        n, tail = parent.sampling.n, parent.num_prompt_tokens - 1
        for index in range(n - 1, 0, -1):  # queued at the front: choice 1 ends up first
            sid = choice_id(parent.group_id, index)
            sampling = choice_sampling(parent.sampling, index)
            seq = Sequence(
                sid,
                parent.prompt_token_ids,
                sampling,
                "full",
                parent.need_blocks,
                index=index,
                group_id=parent.group_id,
            )
            seq.block_hashes = parent.block_hashes[: tail // self.kv_cache.tokens_per_block]
            if self.kv_cache.fork(parent.request_id, sid, tail) is not None:
                seq.num_computed_tokens = tail
            detok = IncrementalDetokenizer(self.tokenizer, sampling.stop)
            self._live[sid] = LiveSequence(seq, sink, detok, self._grammar(sampling))
            self._groups[parent.group_id].append(sid)
            self.scheduler.add(seq, front=True)

    def abort(self, request_id: str) -> None:
        """End ``request_id`` (every choice) wherever it is: a reservation or parked blocks are
        freed now; a queued or running request is removed by the engine thread before its next
        step (its sink then gets ``finish_reason=ABORT`` per unfinished choice). Unknown ids are
        ignored. The caller must not abort while a KV transfer into the request's reserved
        blocks may still land."""
        self.free_parked(request_id)
        self.unreserve(request_id)
        with self._lock:
            if request_id in self._groups:
                self._aborts.add(request_id)
        self._wakeup.set()

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        reuse_prefix: bool = False,
    ) -> Reservation:
        """Allocate the prompt's blocks, in token order (``ceil(len(prompt) / tpb)`` ids; under
        ``guaranteed_no_evict`` the whole completion is admitted too). With ``reuse_prefix``
        the table starts with the prompt's longest cached prefix of full blocks
        (``Reservation.cached_blocks`` of them already hold its K/V: delta transfer). The
        caller writes the prompt's K/V into ``Reservation.missing_block_ids``, then submits the
        ``resume`` request with the same id, or calls :meth:`unreserve`. Raises
        :class:`CapacityError` when the blocks are not free now (the caller may retry),
        :class:`InvalidRequestError` as :meth:`add_request` does."""
        prompt = list(prompt_token_ids)
        self.limits.check(request_id, prompt, sampling, "resume", 0)
        with self._lock:
            if self._shut_down:
                raise InvalidRequestError("the engine is shut down")
            in_use = request_id in self._groups or request_id in self.parked
            if in_use or request_id in self.scheduler.reserved:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            need = self.kv_cache.get_needed_resource_to_completion(len(prompt), sampling.max_tokens)
            seq = Sequence(request_id, prompt, sampling, "resume", need)
            blocks = self.scheduler.reserve(seq, reuse_prefix=reuse_prefix)
            return Reservation(blocks, seq.num_cached_tokens // self.kv_cache.tokens_per_block)

    def unreserve(self, request_id: str) -> None:
        """Drop a reservation not yet submitted, freeing its blocks. Idempotent."""
        if self.scheduler.unreserve(request_id):
            self._wakeup.set()

    def free_parked(self, request_id: str) -> None:
        """Release the blocks a prefill-mode request parked. Idempotent."""
        with self._lock:
            blocks = self.parked.pop(request_id, None)
        if blocks is not None:
            self.kv_cache.free(request_id)
            self._wakeup.set()

    def load(self) -> WorkerLoad:
        """Snapshot of queue lengths (sequences), KV blocks and preemptions so far."""
        with self._lock:
            parked = len(self.parked)
        return WorkerLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            parked=parked,
            free_blocks=self.kv_cache.get_num_free_blocks(),
            total_blocks=self.kv_cache.get_max_resource_count(),
            preemptions=self.scheduler.num_preemptions,
            spec_drafts=self.spec.drafts,
            spec_draft_tokens=self.spec.draft_tokens,
            spec_accepted_tokens=self.spec.accepted_tokens,
        )

    def kv_connector_stats(self) -> KVConnectorStats | None:
        """The KV cache connector's counters (None: no tier configured)."""
        return self.connector.stats() if self.connector is not None else None

    # --- the step loop (engine thread) -----------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._wakeup.clear()
                self._apply_aborts()
                batch = self.scheduler.schedule()
                if not batch:
                    self._wakeup.wait(0.05)
                    continue
                self._step(batch)
            except Exception:  # never die silently: log and keep serving
                log.exception("engine loop error")
                self._stopping.wait(0.1)
        self._drain()

    @torch.inference_mode()
    def _step(self, batch: ScheduledBatch) -> None:
        sampling = batch.sampling
        try:
            if self.connector is not None:  # tier hits go into their blocks first
                self.connector.start_step(batch.items)
            logits = self.runner.execute(batch, self.kv_cache)
            rows, prompt_rows = kept_rows(batch)
            if prompt_rows:  # a prefill chunk kept every position: its prompt logprobs
                for s, row in prompt_rows:
                    live = self._live[s.request_id]
                    chunk = logits[row : row + s.num_new_tokens]
                    live.prompt_lps = record_prompt_logprobs(live.prompt_lps, s, chunk)
                logits = logits[rows]
            picks = [(s, j) for s in sampling for j in range(s.num_rows)]  # drafts: k + 1 rows
            result = self.sampler.sample(
                logits,
                [s.seq.sampling for s, _ in picks],
                [s.seq.next_output_position + j for s, j in picks],
                [s.seq for s, _ in picks],
                [self._live[s.seq.request_id].grammar for s, _ in picks],
            )
        except Exception as exc:
            log.exception("step failed; ending its %d requests", len(batch.items))
            for s in batch.items:
                self._end(s.seq, FinishReason.ERROR, error=f"engine step failed: {exc!r}")
            return
        self.kv_cache.update_resources(batch.items)  # drafts' blocks: once verified
        if self.connector is not None:
            self.connector.finish_step()  # queue the completed blocks for the disk tier
        first = 0
        for s in batch.items:
            s.seq.num_computed_tokens = s.num_kv_tokens_after_step
            live = self._live[s.request_id]  # streamed hand-off: report the completed blocks
            if live.progress and (out := progress_output(s.seq, self.kv_cache)) is not None:
                self._emit(live.sink, out)
        for s in sampling:
            tokens = result.token_ids[first : first + s.num_rows]
            lps = result.logprobs[first : first + s.num_rows]
            first += s.num_rows
            if s.draft:  # keep the verified prefix: its K/V is the sequence's now
                tokens, lps = self.spec.verify(s.seq, s.draft, tokens, lps)
            for token, lp in zip(tokens, lps, strict=True):
                try:
                    if self._append_token(s.seq, token, lp):
                        break  # finished: the rest of its tokens are dropped
                except GrammarError as exc:  # the request's own: one line, no traceback
                    log.warning("request %s: %s", s.request_id, exc.message)
                    self._end(s.seq, FinishReason.ERROR, error=exc.message, code=exc.code)
                    break
                except Exception as exc:
                    log.exception("output processing of %s failed", s.request_id)
                    self._end(s.seq, FinishReason.ERROR, error=f"output processing failed: {exc!r}")
                    break

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> bool:
        """Append and emit ``token``; True when that ended ``seq``'s work here (or prefill's)."""
        live = self._live[seq.request_id]
        first = not seq.output_token_ids
        seq.output_token_ids.append(token)
        seq.status = SequenceStatus.DECODE
        if token not in seq.sampling.stop_token_ids:  # a stop token's text is not emitted
            live.detok.append(token)
        if live.grammar is not None:
            live.grammar.consume(token)
        reason = self.limits.stop_reason(live, token, self.eos_token_ids)
        out = EngineOutput(
            seq.group_id,
            [token],
            live.detok.delta(final=reason is not None),
            [lp] if lp is not None else [],
            reason,
            index=seq.index,
            cached_tokens=seq.num_cached_tokens if first else None,
            prompt_logprobs=live.prompt_lps if first and seq.index == 0 else None,
            admitted_s=seq.admitted_s,
            preemptions=seq.num_preemptions,
        )
        if seq.mode == "prefill":
            self._end_prefill_leg(seq, out)
            return True
        if first and live.fork:
            with self._lock:
                self._fork_choices(seq, live.sink)
        if reason is not None:
            self._retire(seq, out)
            return True
        self._emit(live.sink, out)
        return False

    def _end_prefill_leg(self, seq: Sequence, out: EngineOutput) -> None:
        """Prefill produces exactly one token: the only exit of a prefill-mode sequence. Right
        after its first token it leaves ``running``; unless that token finished the request
        (and ``n == 1``: other choices still need the prompt), its prompt blocks are PARKED for
        the caller and listed in the output."""
        assert seq.mode == "prefill" and len(seq.output_token_ids) == 1
        if out.finish_reason is not None and seq.sampling.n == 1:
            self._retire(seq, out)
            return
        self.scheduler.finish(seq, free_blocks=False)
        blocks = self.kv_cache.block_table(seq.request_id)
        with self._lock:
            self.parked[seq.request_id] = blocks
        live = self._forget(seq)
        seq.status = SequenceStatus.PARKED
        self._emit(live.sink, replace(out, parked_block_ids=list(blocks)))

    def _forget(self, seq: Sequence) -> LiveSequence:
        """Drop a finished (or parked) sequence from the live tables; the request leaves them
        with its last sequence."""
        with self._lock:
            live = self._live.pop(seq.request_id)
            group = self._groups.get(seq.group_id)
            if group is not None:
                group.remove(seq.request_id)
                if not group:
                    del self._groups[seq.group_id]
        return live

    def _retire(self, seq: Sequence, out: EngineOutput) -> None:
        """FINISHED: free the blocks, drop the sequence, send its last output."""
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        self._emit(self._forget(seq).sink, out)

    def _end(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None = None,
        code: str | None = None,
    ) -> None:
        """End a queued or running sequence early (abort, error): free its blocks, tell the
        sink. ``code``: a request error's code (:attr:`EngineOutput.error_code`)."""
        self.scheduler.remove(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        with self._lock:
            known = seq.request_id in self._live
            live = self._forget(seq) if known else None
        if live is not None:
            out = EngineOutput(
                seq.group_id, [], "", [], reason, error, index=seq.index, error_code=code
            )
            self._emit(live.sink, out)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            sids = [sid for rid in aborts for sid in self._groups.get(rid, ())]
            seqs = [self._live[sid].seq for sid in sids]
        for seq in seqs:
            self._end(seq, FinishReason.ABORT)

    def _drain(self) -> None:
        """After the loop: abort every live request, free parked blocks and reservations."""
        with self._lock:
            seqs = [live.seq for live in self._live.values()]
            parked = list(self.parked)
        for seq in seqs:
            self._end(seq, FinishReason.ABORT, error="engine shut down")
        for rid in parked:
            self.free_parked(rid)
        for rid in list(self.scheduler.reserved):
            self.unreserve(rid)

    @staticmethod
    def _emit(sink: Sink, out: EngineOutput) -> None:
        try:
            sink(out)
        except Exception:  # a broken sink must not take the engine down
            log.exception("sink of request %s raised", out.request_id)
