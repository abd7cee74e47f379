"""CUDA graphs of decode-only steps (the vLLM / SGLang approach).

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: every
layer of transformers' Llama launches about 48 small kernels. :class:`DecodeGraphs` records the
forward of a decode-only step once per shape and replays it afterwards with one launch.

Shapes are made static by padding:

- the batch to a bucket ``B`` in :data:`BATCH_BUCKETS` (1, 2, 4, ..., the first power of two
  that holds ``max_num_seqs``);
- the block tables to a width ``W`` (blocks per sequence): the next power of two, at least
  :data:`MIN_TABLE_WIDTH`, of the longest table the step needs.

One graph per ``(B, W)``, captured lazily the first time a step needs it (one eager warm-up run
on a side stream, then the capture; graphs share one memory pool). All inputs of a step are
packed into one ``int64`` buffer ``[5 * B + B * W]`` (token ids, positions, K slots, write rows,
context lengths, block tables), written into pinned host memory and copied to the GPU with one
asynchronous copy before the replay.

Padded rows repeat row 0 (its token, position, slots, table and context), so they attend to
valid K/V, and they write row 0's K/V (``PagedAttentionMetadata.write_rows``): duplicate slots
in the pool write then receive identical bytes. The decode attention always uses the
``[B, 1, 1, W * tpb]`` mask built inside the graph from the context lengths. transformers'
packed-sequence check (a host sync, not allowed during a capture) is skipped by passing a 4D
``attention_mask``, which ``create_causal_mask`` returns as is (the paged attention ignores it).

Steps with prefill tokens, more sequences than the largest bucket, or a shape whose capture
failed run eagerly (:meth:`DecodeGraphs.run` returns None). The engine thread is the only user:
not thread-safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.workers.engine.model.attention import METADATA_KWARG, PagedAttentionMetadata
from pdserve.workers.engine.scheduler import ScheduledBatch
from pdserve.workers.kv.manager import KVCacheManager

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_WIDTH = 8
MAX_GRAPHS = 128


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Shape:
    """Static buffers (and the graph) of one ``(batch, width)`` shape."""

    batch: int
    width: int
    host: torch.Tensor  # [5B + B*W] int64 (pinned on CUDA; the device buffer itself on CPU)
    dev: torch.Tensor  # [5B + B*W] int64 on the model's device
    positions_range: torch.Tensor  # [W * tpb] int64 on the device
    copied: torch.cuda.Event | None = None
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [B, vocab], the graph's output
    views: dict[str, torch.Tensor] = field(default_factory=dict)


class DecodeGraphs:
    """Runs decode-only steps through CUDA graphs, one per padded ``(batch, table width)``.

    ``model``: the transformers causal LM (paged attention registered), on ``device``.
    ``max_num_seqs``: the scheduler's limit; buckets stop at the first one that holds it.
    ``capture=False`` runs the same padded, static-shape forward eagerly instead of recording
    it (any device): used to test the padding and masking on CPU.

    Counters: ``captures`` (graphs recorded), ``replays`` (steps served by a graph or, with
    ``capture=False``, by the static path), ``failures`` (shapes whose capture raised; they run
    eagerly from then on).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        max_num_seqs: int,
        capture: bool = True,
    ):
        self.model = model
        self.device = device
        self.capture = capture
        top = _next_pow2(max_num_seqs)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b <= top)
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._failed: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._pool_ptr: int | None = None
        # transformers returns a 4D mask as is: no packed-sequence check (a host sync)
        self._mask4d = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self.captures = 0
        self.replays = 0
        self.failures = 0

    def shape_for(self, num_seqs: int, num_blocks: int) -> tuple[int, int] | None:
        """The padded ``(batch, width)`` for ``num_seqs`` sequences whose longest block table has
        ``num_blocks`` blocks, or None when no bucket holds ``num_seqs``."""
        batch = next((b for b in self.batch_buckets if b >= num_seqs), None)
        if batch is None:
            return None
        return batch, max(MIN_TABLE_WIDTH, _next_pow2(num_blocks))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, kv_cache: KVCacheManager) -> torch.Tensor | None:
        """Run ``batch`` through a graph if it is decode-only and fits a bucket: returns float32
        logits ``[len(batch.decode), vocab]`` (a fresh tensor), else None (run it eagerly). The
        step's K/V is written into ``kv_cache.pool`` as in the eager path."""
        decode = batch.decode
        if batch.prefill or not decode or not all(s.samples for s in decode):
            return None
        if self._pool_ptr is None:
            self._pool_ptr = kv_cache.pool.data_ptr()
        elif self._pool_ptr != kv_cache.pool.data_ptr():
            raise RuntimeError("DecodeGraphs serves one KV pool; a different pool was passed")
        tpb = kv_cache.tokens_per_block
        tables = kv_cache.get_batch_cache_indices(s.request_id for s in decode)
        need = max(s.start_position // tpb + 1 for s in decode)
        key = self.shape_for(len(decode), need)
        if key is None or key in self._failed:
            return None
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= MAX_GRAPHS:
                return None
            shape = self._new_shape(*key, tpb)
        self._fill(shape, batch, tables, tpb)
        if shape.logits is None:  # first use of this shape
            if not self._record(shape, kv_cache, key):
                return None
        elif shape.graph is not None:
            shape.graph.replay()
        else:
            shape.logits = self._forward(shape, kv_cache, tpb)
        self.replays += 1
        assert shape.logits is not None
        return shape.logits[: len(decode)].to(torch.float32, copy=True)

    # --- internals -----------------------------------------------------------------------------

    def _new_shape(self, b: int, w: int, tpb: int) -> _Shape:
        n = 5 * b + b * w
        dev = torch.zeros(n, dtype=torch.long, device=self.device)
        on_cuda = self.device.type == "cuda"
        host = torch.zeros(n, dtype=torch.long, pin_memory=True) if on_cuda else dev
        shape = _Shape(
            batch=b,
            width=w,
            host=host,
            dev=dev,
            positions_range=torch.arange(w * tpb, device=self.device),
            copied=torch.cuda.Event() if on_cuda else None,
        )
        parts = dev[: 5 * b].view(5, b)
        shape.views = {
            "ids": parts[0],
            "positions": parts[1],
            "k_slots": parts[2],
            "write_rows": parts[3],
            "ctx": parts[4],
            "tables": dev[5 * b :].view(b, w),
        }
        self._shapes[(b, w)] = shape
        return shape

    def _fill(
        self, shape: _Shape, batch: ScheduledBatch, tables: dict[str, list[int]], tpb: int
    ) -> None:
        """Write the step's inputs into the host buffer, padded rows repeating row 0, and copy
        them to the device buffer (one asynchronous copy on CUDA)."""
        b, w = shape.batch, shape.width
        if shape.copied is not None:
            shape.copied.synchronize()  # the previous copy from this pinned buffer is done
        buf = shape.host.numpy()
        head = buf[: 5 * b].reshape(5, b)
        table_rows = buf[5 * b :].reshape(b, w)
        table_rows.fill(0)
        for i, s in enumerate(batch.decode):
            pos = s.start_position
            table = tables[s.request_id][: pos // tpb + 1]
            (head[0, i],) = s.token_ids()
            head[1, i] = pos
            head[2, i] = table[pos // tpb] * 2 * tpb + pos % tpb
            head[3, i] = i
            head[4, i] = pos + 1
            table_rows[i, : len(table)] = table
        nd = len(batch.decode)
        if nd < b:
            head[:, nd:] = head[:, :1]
            head[3, nd:] = 0
            table_rows[nd:] = table_rows[0]
        if shape.copied is not None:
            shape.dev.copy_(shape.host, non_blocking=True)
            shape.copied.record()

    def _forward(self, shape: _Shape, kv_cache: KVCacheManager, tpb: int) -> torch.Tensor:
        """The padded decode forward on the static buffers: logits ``[B, vocab]``."""
        v = shape.views
        mask = shape.positions_range[None, :] < v["ctx"][:, None]
        meta = PagedAttentionMetadata(
            pool=kv_cache.pool,
            k_slots=v["k_slots"],
            v_slots=v["k_slots"] + tpb,
            num_decode=shape.batch,
            decode_block_tables=v["tables"],
            decode_mask=mask[:, None, None, :],
            decode_ctx_len=0,
            prefill=(),
            write_rows=v["write_rows"],
        )
        out = self.model(
            input_ids=v["ids"].unsqueeze(0),
            position_ids=v["positions"].unsqueeze(0),
            attention_mask=self._mask4d,
            use_cache=False,
            **{METADATA_KWARG: meta},
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def _record(self, shape: _Shape, kv_cache: KVCacheManager, key: tuple[int, int]) -> bool:
        """Warm up and capture ``shape``'s graph, then replay it for the current step. False
        (and the shape runs eagerly from then on) when the capture fails."""
        tpb = kv_cache.tokens_per_block
        if not self.capture:
            shape.logits = self._forward(shape, kv_cache, tpb)
            return True
        try:
            main = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._forward(shape, kv_cache, tpb)  # warm-up: lazy init, kernel choice
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(shape, kv_cache, tpb)
        except Exception:
            log.warning(
                "CUDA graph capture of decode shape (batch %d, %d blocks) failed; "
                "that shape runs eagerly",
                *key,
                exc_info=True,
            )
            self._failed.add(key)
            self._shapes.pop(key, None)
            self.failures += 1
            return False
        shape.graph, shape.logits = graph, logits
        self.captures += 1
        log.info(
            "captured a CUDA graph for decode batch %d, %d blocks per sequence (%d graphs)",
            *key,
            self.captures,
        )
        graph.replay()
        return True
