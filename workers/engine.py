"""Engine: one model, one KV block pool, a continuous-batching step loop on its own thread.

Request lifecycle (the numbered states of :class:`SequenceStatus`; the queues are named after
them)::

    1. RESERVED  resume only: reserve() admitted the whole completion and allocated the prompt's
                 blocks, which the caller fills (KV transfer).        queue: scheduler.reserved
    2. WAITING   add_request() validated it; waits for admission (KV headroom for
                 prompt + max_tokens - 1 tokens, a running slot).      queue: scheduler.waiting
    3. PREFILL   admitted; the prompt's K/V is computed, in chunks.   queue: scheduler.running
    4. DECODE    one token per step.                                  queue: scheduler.running
    5. PARKED    prefill mode only: its one token went out; the prompt's blocks belong to the
                 caller until free_parked().                          queue: Engine.parked
    6. FINISHED  the last output (finish_reason set) went to the sink; blocks freed.

    full: 2 -> 3 -> 4 -> 6     prefill: 2 -> 3 -> 5 (or 6)     resume: 1 -> 2 -> 4 -> 6
    abort(): 1..5 -> 6 (the sink gets finish_reason ABORT in 2..4)

Each step (nano-vllm's ``LLMEngine.step``): the scheduler picks every running decode sequence
plus prefill chunks and allocates their blocks, the model runner runs one forward, the sampler
picks one token per sequence that reached its last known token, and the engine appends it,
checks the stop conditions, emits an :class:`EngineOutput` to the request's sink, and frees,
parks or keeps the sequence. A failing step ends the sequences of that step with an error output
and frees their blocks; the loop carries on.

Thread-safety: every public method may be called from any thread. Sinks run on the engine thread
and must not block. Aborts of queued or running requests are applied by the engine thread
between steps, so blocks are never freed under a running forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.errors import ConfigError, InvalidRequestError
from pdserve.protocol import FinishReason, KVLayout, SamplingParams, TokenLogprob, WorkerLoad
from pdserve.workers.kv_cache import KVCacheManager, num_blocks_for_budget
from pdserve.workers.model_runner import ModelRunner
from pdserve.workers.requests import EngineOutput, EngineRequest, RequestLimits, Sink
from pdserve.workers.sampler import Sampler
from pdserve.workers.scheduler import ScheduledBatch, Scheduler
from pdserve.workers.sequence import IncrementalDetokenizer, Sequence, SequenceStatus

__all__ = ["Engine", "EngineOutput", "EngineRequest", "Sink"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Live:
    seq: Sequence
    sink: Sink
    detok: IncrementalDetokenizer


def _model_digest(model_path: Path) -> str:
    config = json.loads((model_path / "config.json").read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


class Engine:
    """The engine of ``docs/architecture.md``. Loads model and tokenizer, allocates the pool.

    Attributes: ``layout`` (:class:`KVLayout`, ``model`` = served name + config digest),
    ``tokenizer``, ``kv_cache`` (:class:`KVCacheManager`, ``.pool`` is the tensor),
    ``max_model_len``, ``eos_token_ids``, ``parked`` (request id -> block ids).
    Raises :class:`ConfigError` for an unusable model folder or ``max_model_len``.
    """

    def __init__(self, cfg: EngineConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        path = Path(cfg.model_path)
        self.runner = ModelRunner(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        limit = self.runner.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's {limit}")
        self.max_model_len: int = cfg.max_model_len or limit
        eos = self.runner.model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.layout = KVLayout(
            model=f"{cfg.served_model_name}-{_model_digest(path)}",
            num_layers=self.runner.num_layers,
            num_kv_heads=self.runner.num_kv_heads,
            head_dim=self.runner.head_dim,
            tokens_per_block=cfg.tokens_per_block,
            dtype=cfg.cache_dtype,
        )
        num_blocks = cfg.num_blocks or num_blocks_for_budget(self.layout, cfg.kv_cache_bytes)
        self.kv_cache = KVCacheManager(self.layout, num_blocks, cfg.device)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )
        self.limits = RequestLimits(self.runner.vocab_size, self.max_model_len, self.kv_cache)
        self.sampler = Sampler()
        self.parked: dict[str, list[int]] = {}
        self._live: dict[str, _Live] = {}
        self._aborts: set[str] = set()
        self._lock = threading.RLock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._shut_down = False

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (once)."""
        with self._lock:
            if self._thread is None and not self._shut_down:
                self._thread = threading.Thread(target=self._loop, name="pdserve-engine")
                self._thread.daemon = True
                self._thread.start()

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
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("engine thread did not stop within %.1f s", timeout)
                return
        self._drain()

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, sink: Sink) -> None:
        """Queue ``req``; its outputs go to ``sink`` (on the engine thread). Raises
        :class:`InvalidRequestError` (bad tokens, too long for ``max_model_len``, duplicate id,
        resume without :meth:`reserve`, engine shut down) or :class:`CapacityError` (can never
        fit the pool). A refused ``resume`` request frees its reservation."""
        prompt = list(req.prompt_token_ids)
        try:
            self.limits.check(req.request_id, prompt, req.sampling, req.mode, req.first_token)
            with self._lock:
                if self._shut_down:
                    raise InvalidRequestError("the engine is shut down")
                if req.request_id in self._live or req.request_id in self.parked:
                    raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
                detok = IncrementalDetokenizer(self.tokenizer, req.sampling.stop)
                if req.mode == "resume":
                    seq = self._resume_from_reservation(req, prompt, detok)
                else:
                    seq = Sequence(req.request_id, prompt, req.sampling, req.mode, self._need(req))
                self._live[req.request_id] = _Live(seq, sink, detok)  # before the engine sees it
                try:
                    self.scheduler.add(seq)
                except Exception:
                    del self._live[req.request_id]
                    raise
        except Exception:
            if req.mode == "resume":  # a refused resume gives its reservation back
                self.unreserve(req.request_id)
            raise
        self._wakeup.set()

    def _need(self, req: EngineRequest) -> int:
        max_new = 1 if req.mode == "prefill" else req.sampling.max_tokens
        return self.kv_cache.get_needed_resource_to_completion(len(req.prompt_token_ids), max_new)

    def _resume_from_reservation(
        self, req: EngineRequest, prompt: list[int], detok: IncrementalDetokenizer
    ) -> Sequence:
        seq = self.scheduler.reserved.get(req.request_id)
        if seq is None:
            raise InvalidRequestError(f"resume of {req.request_id!r} without reserve()")
        if seq.prompt_token_ids != prompt or self._need(req) > seq.need_blocks:
            raise InvalidRequestError(f"resume of {req.request_id!r} differs from its reserve()")
        assert req.first_token is not None
        seq.sampling = req.sampling
        seq.output_token_ids = [req.first_token]
        seq.num_computed_tokens = len(prompt)
        # Replay what the prefill leg emitted for the first token so deltas continue from it.
        detok.append(req.first_token)
        detok.delta()
        return seq

    def abort(self, request_id: str) -> None:
        """End ``request_id`` wherever it is: a reservation or parked blocks are freed now; a
        queued or running request is removed by the engine thread before its next step (its
        sink then gets ``finish_reason=ABORT``). Unknown ids are ignored. The caller must not
        abort while a KV transfer into the request's reserved blocks may still land."""
        self.free_parked(request_id)
        self.unreserve(request_id)
        with self._lock:
            if request_id in self._live:
                self._aborts.add(request_id)
        self._wakeup.set()

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[int]:
        """Capacity check for the whole completion (prompt + ``max_tokens`` - 1 tokens) and
        allocation of the prompt's blocks, in token order (``ceil(len(prompt) / tpb)`` ids).
        The caller writes the prompt's K/V into them, then submits the ``resume`` request with
        the same id, or calls :meth:`unreserve`. Raises :class:`CapacityError` when the headroom
        is short, :class:`InvalidRequestError` as :meth:`add_request` does."""
        prompt = list(prompt_token_ids)
        self.limits.check(request_id, prompt, sampling, "resume", 0)
        with self._lock:
            if self._shut_down:
                raise InvalidRequestError("the engine is shut down")
            in_use = request_id in self._live or request_id in self.parked
            if in_use or request_id in self.scheduler.reserved:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            need = self.kv_cache.get_needed_resource_to_completion(len(prompt), sampling.max_tokens)
            seq = Sequence(request_id, prompt, sampling, "resume", need)
            return self.scheduler.reserve(seq)

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
        """Snapshot of queue lengths and KV blocks."""
        with self._lock:
            parked = len(self.parked)
        return WorkerLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            parked=parked,
            free_blocks=self.kv_cache.get_num_free_blocks(),
            total_blocks=self.kv_cache.get_max_resource_count(),
        )

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
            logits = self.runner.execute(batch, self.kv_cache)
            result = self.sampler.sample(
                logits,
                [s.seq.sampling for s in sampling],
                [s.seq.next_output_position for s in sampling],
            )
        except Exception as exc:
            log.exception("step failed; ending its %d requests", len(batch.items))
            for s in batch.items:
                self._end(s.seq, FinishReason.ERROR, error=f"engine step failed: {exc!r}")
            return
        self.kv_cache.update_resources(batch.items)
        for s in batch.items:
            s.seq.num_computed_tokens = s.num_kv_tokens_after_step
        for s, token, lp in zip(sampling, result.token_ids, result.logprobs, strict=True):
            try:
                self._append_token(s.seq, token, lp)
            except Exception as exc:
                log.exception("output processing of %s failed", s.request_id)
                self._end(s.seq, FinishReason.ERROR, error=f"output processing failed: {exc!r}")

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        live = self._live[seq.request_id]
        seq.output_token_ids.append(token)
        seq.status = SequenceStatus.DECODE
        live.detok.append(token)
        reason = self._stop_reason(seq, token, live.detok)
        out = EngineOutput(
            seq.request_id,
            [token],
            live.detok.delta(final=reason is not None),
            [lp] if lp is not None else [],
            reason,
        )
        if seq.mode == "prefill":
            self._end_prefill_leg(seq, out)
        elif reason is not None:
            self._retire(seq, out)
        else:
            self._emit(live.sink, out)

    def _stop_reason(
        self, seq: Sequence, token: int, detok: IncrementalDetokenizer
    ) -> FinishReason | None:
        if token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return FinishReason.STOP
        if detok.stopped is not None:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _end_prefill_leg(self, seq: Sequence, out: EngineOutput) -> None:
        """Prefill produces exactly one token: the only exit of a prefill-mode sequence. Right
        after its first token it leaves ``running``; unless that token finished the request, its
        prompt blocks are PARKED for the caller and listed in the output."""
        assert seq.mode == "prefill" and len(seq.output_token_ids) == 1
        if out.finish_reason is not None:
            self._retire(seq, out)
            return
        self.scheduler.finish(seq, free_blocks=False)
        blocks = self.kv_cache.block_table(seq.request_id)
        with self._lock:
            live = self._live.pop(seq.request_id)
            self.parked[seq.request_id] = blocks
        seq.status = SequenceStatus.PARKED
        self._emit(live.sink, replace(out, parked_block_ids=list(blocks)))

    def _retire(self, seq: Sequence, out: EngineOutput) -> None:
        """FINISHED: free the blocks, drop the request, send its last output."""
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        with self._lock:
            live = self._live.pop(seq.request_id)
        self._emit(live.sink, out)

    def _end(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a queued or running sequence early (abort, error): free its blocks, tell the
        sink."""
        self.scheduler.remove(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        with self._lock:
            live = self._live.pop(seq.request_id, None)
        if live is not None:
            self._emit(live.sink, EngineOutput(seq.request_id, [], "", [], reason, error))

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            seqs = [self._live[rid].seq for rid in aborts if rid in self._live]
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
