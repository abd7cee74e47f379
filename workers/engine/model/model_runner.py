"""Model runner: loads a transformers causal LM with paged attention and runs one step.

It turns a :class:`ScheduledBatch` into flattened (varlen, batch 1) model inputs with explicit
``position_ids`` and the :class:`PagedAttentionMetadata` of the step, runs one forward pass, and
projects only the rows that sample through the LM head (transformers' ``logits_to_keep`` with an
index tensor), as vLLM's Transformers backend does. Any decoder whose attention goes through
transformers' ``AttentionInterface`` and passes ``**kwargs`` down to it runs here. On CPU (with
``EngineConfig.compile``, the default) the forward runs oneDNN-prepacked linears through one
``torch.compile`` graph compiled at start-up (:mod:`pdserve.workers.engine.model.compile`); with
``compile=False``, and when compiling fails, transformers' eager forward. On CUDA (with
``EngineConfig.cuda_graphs``) decode-only steps replay CUDA graphs instead
(:mod:`pdserve.workers.engine.model.cuda_graphs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.config.loading import EngineConfig
from pdserve.errors import ConfigError
from pdserve.hardware import choose_dtype
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.model import load_check as probe
from pdserve.workers.engine.model import paged_kernel, parallel
from pdserve.workers.engine.model.attention import (
    METADATA_KWARG,
    KernelRows,
    PagedAttentionMetadata,
    PrefillChunk,
    bottom_right_causal_mask,
    register_paged_attention,
    workspace_numel,
)
from pdserve.workers.engine.model.compile import CompiledForward, can_prepack, prepack_linears
from pdserve.workers.engine.model.cuda_graphs import DecodeGraphs
from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.kv.sizing import cuda_kv_budget

log = logging.getLogger(__name__)

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""``config.layer_types`` values the paged attention serves (sliding windows: the ``sliding_window``
kwarg each such layer passes)."""

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    """Owns the model. ``num_layers``, ``num_kv_heads``, ``head_dim``, ``vocab_size`` and
    ``max_position_embeddings`` describe it for the KV layout (the whole model's, whatever
    the tensor parallel split). ``compiled`` is the compiled forward (None: eager), compiled in
    the constructor (``compiled.compile_s`` seconds, logged).

    Tensor parallel (``model.tensor_parallel_size`` N > 1, CPU): the runner of rank 0 spawns
    ranks 1..N-1 (``ranks``, :class:`~pdserve.workers.engine.model.parallel.RankGroup`) and every
    runner holds its rank's shard of the model (``rank``); rank 0 sends each step to the other
    ranks before running it. The forward is then eager (no compiled forward, no CUDA graphs).
    Not thread-safe: run steps from one thread (the engine thread). :meth:`close` stops the
    ranks."""

    def __init__(self, cfg: EngineConfig, *, rank: int = 0):
        if cfg.scheduler.threads:
            torch.set_num_threads(cfg.scheduler.threads)  # process-wide intra-op pool
        self.device = torch.device(cfg.model.device)
        path = Path(cfg.model_path)
        # CPU: the in-place paged attention kernel, built now (tens of seconds the first time
        # on a machine, then torch's cached build) rather than on the first request
        self.in_place = self.device.type == "cpu" and paged_kernel.available()
        choice = choose_dtype(cfg.model.dtype, path, cfg.model.device, in_place=self.in_place)
        if rank == 0:
            log.info("model dtype %s: %s", choice.dtype, choice.reason)
        self.dtype_name: str = choice.dtype
        self.dtype = TORCH_DTYPES[choice.dtype]
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {path} has no config.json")
        self.rank, self.tp_size = rank, cfg.model.tensor_parallel_size
        self.tp_group = parallel.GroupRef()
        self.ranks: parallel.RankGroup | None = None
        if self.tp_size > 1 and self.device.type != "cpu":
            raise ConfigError(
                "tensor_parallel_size > 1 runs on CPU (gloo) in this version; CUDA ranks "
                "(NCCL, one device each) are not built yet"
            )
        if self.tp_size > 1 and rank == 0:  # the ranks load their shards while this one does
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
            parallel.check_shardable(text, self.tp_size, path)
            self.ranks = parallel.RankGroup(cfg, rank_main)
        try:
            self._load(cfg, path)
        except BaseException:
            self.close()
            raise

    def _load(self, cfg: EngineConfig, path: Path) -> None:
        """Load, check (:mod:`~pdserve.workers.engine.model.load_check`), shard and compile the model."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=self.dtype,
            attn_implementation=register_paged_attention(),
            local_files_only=True,
        )
        torch.nn.Module.to(self.model, self.device).train(False)  # eval mode
        text = self.model.config.get_text_config()
        other = sorted(set(getattr(text, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES)
        if other:
            raise ConfigError(
                f"{path}: {type(self.model).__name__} has {', '.join(other)} layers; the paged "
                f"attention serves {' and '.join(sorted(SUPPORTED_LAYER_TYPES))} layers only"
            )
        if cfg.model.quantization == "int8":
            quantize_int8(self.model, self.tp_size)
        elif cfg.model.quantization == "w8a8":
            check_w8a8(self.device, self.dtype, self.tp_size)
            if not cfg.model.compile:  # the compiled forward prepacks them itself
                prepack_linears(self.model, int8=True)
        self.num_layers: int = text.num_hidden_layers
        self.vocab_size: int = text.vocab_size
        self.max_position_embeddings: int = text.max_position_embeddings
        self._workspace: torch.Tensor | None = None  # PagedAttentionMetadata.workspace
        if self.rank == 0 and self.device.type == "cpu":
            how = "in-place kernel" if self.in_place else "gather + SDPA"
            why = "" if self.in_place else f" ({paged_kernel.unavailable_reason()})"
            log.info("paged attention: %s%s", how, why)
        shape = probe.capture_kv_shapes(self.model, self.device, self.num_layers)
        self.num_kv_heads: int = shape.num_kv_heads  # what the attention receives
        self.head_dim: int = shape.head_dim
        if self.rank == 0 and cfg.model.load_check:
            probe.check_against_reference(self, shape)
        if self.tp_size > 1:
            parallel.shard_model(
                self.model,
                self.tp_size,
                self.rank,
                self.head_dim,
                self.num_kv_heads,
                self.tp_group,
            )
            if self.ranks is not None:
                self.tp_group.group = self.ranks.join()
                log.info(
                    "tensor parallel: %d ranks joined (gloo); forward runs eagerly", self.tp_size
                )
        self.graphs: DecodeGraphs | None = None
        if cfg.scheduler.cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                self.model, self.device, max_num_seqs=cfg.scheduler.max_num_seqs
            )
        self.compiled: CompiledForward | None = None
        if cfg.model.compile and self.device.type == "cpu" and self.tp_size == 1:
            if cfg.model.quantization != "int8":
                self.compiled = self._compile(int8=cfg.model.quantization == "w8a8")
            else:
                log.info("int8 weights: the forward runs eagerly (prepacking needs float weights)")

    def _compile(self, int8: bool) -> CompiledForward | None:
        """Prepack (W8A8 with ``int8``) and compile now (start-up), or None (eager) when that
        fails."""
        try:
            compiled = CompiledForward(self.model, self.device, self.dtype, int8=int8)
            compiled.warm_up(self.num_layers, self.num_kv_heads, self.head_dim)
        except Exception:
            log.exception("compiling the model forward failed; running it eagerly")
            return None
        return compiled

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_cache: KVCacheManager) -> torch.Tensor:
        """Run ``batch`` (its blocks already allocated by ``prepare_resources``): writes the
        step's K/V into the pool and returns float32 logits ``[rows, vocab]``: one row per
        sampling sequence in ``batch.sampling`` order, except that a prefill chunk of a request
        asking for prompt logprobs keeps a row for each of its positions (:func:`kept_rows`
        says where each row belongs). Steps run through
        :attr:`compiled` when set (CPU); decode-only steps through :attr:`graphs` when set (CUDA
        graphs); other steps, and shapes that cannot be captured, run eagerly. A compiled step
        that raises is logged and run eagerly, and the runner stays eager from then on."""
        if self.graphs is not None:
            replayed = self.graphs.run(batch, kv_cache)
            if replayed is not None:
                return replayed
        ids, positions, meta, keep = self.prepare_inputs(batch, kv_cache)
        if self.ranks is not None:
            self.ranks.run_step(parallel.step_for_ranks(ids, positions, meta), kv_cache.pool)
        if self.compiled is not None:
            try:
                return self.compiled(ids, positions, keep, meta).float()
            except Exception:
                log.exception("compiled forward failed; running eagerly from now on")
                self.compiled = None
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: meta},
        )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    @torch.inference_mode()
    def run_rank_step(self, step: parallel.Step, shard: torch.Tensor) -> None:
        """Ranks 1..N-1: run rank 0's ``step`` over this rank's pool ``shard`` (``[L, nb, 2,
        tpb, kv_heads_per_rank, hd]``), writing its K/V; no logits are kept (rank 0 samples)."""
        ws = self._workspace_for(shard, step.workspace_numel) if step.workspace_numel else None
        meta = replace(step.meta, pool=shard, workspace=ws)
        self.model(
            input_ids=step.ids.unsqueeze(0),
            position_ids=step.positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=torch.zeros(0, dtype=torch.long),
            **{METADATA_KWARG: meta},
        )

    @torch.inference_mode()
    def profile_cuda_budget(self, layout: KVLayout, num_tokens: int, utilization: float) -> int:
        """CUDA: the KV budget in bytes, :func:`cuda_kv_budget` at ``utilization`` of the
        device's memory after the largest step (``num_tokens`` prompt tokens, e.g.
        ``max_num_batched_tokens``) ran on a scratch pool of ``layout``; logged."""
        dev = self.device
        tpb = layout.tokens_per_block
        scratch = KVCacheManager(layout, -(-num_tokens // tpb), str(dev))
        seq = Sequence("profile", [0] * num_tokens, SamplingParams(max_tokens=1), "prefill", 0)
        scratch.allocate(seq.request_id, num_tokens)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        self.execute(ScheduledBatch(prefill=[ScheduledSequence.of(seq, num_tokens)]), scratch)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(dev)
        in_use = torch.cuda.memory_reserved(dev)
        budget = cuda_kv_budget(total, in_use, peak, utilization)
        log.info(
            "CUDA memory: %.2f GiB total, %.2f GiB held (weights), %.2f GiB peak step of %d "
            "tokens; KV budget at utilization %.2f: %.2f GiB",
            *(total / 2**30, in_use / 2**30, peak / 2**30, num_tokens, utilization),
            budget / 2**30,
        )
        return budget

    def close(self) -> None:
        """Stop the other tensor parallel ranks (idempotent; nothing without them)."""
        if self.ranks is not None:
            self.ranks.close()

    def prepare_inputs(
        self, batch: ScheduledBatch, kv_cache: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, torch.Tensor]:
        """Flatten ``batch`` into ``input_ids`` ``[T]``, ``position_ids`` ``[T]`` (long), the
        attention metadata and the row indices ``[num_sampling]`` whose logits are kept."""
        tpb = kv_cache.tokens_per_block
        tables = kv_cache.get_batch_cache_indices(s.request_id for s in batch.items)
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        k_slots: list[torch.Tensor] = []
        keep: list[int] = []

        # decode tokens: one per sequence, sequence i at row i
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        dec_pos: list[int] = []
        dec_slot: list[int] = []
        for s in batch.decode:
            table = tables[s.request_id]
            p = s.start_position
            ids.extend(s.token_ids())
            dec_pos.append(p)
            dec_slot.append(table[p // tpb] * 2 * tpb + p % tpb)
            decode_tables.append(table[: p // tpb + 1])
            decode_ctx.append(p + 1)
        keep.extend(range(len(batch.decode)))
        positions.append(torch.tensor(dec_pos, dtype=torch.long))
        k_slots.append(torch.tensor(dec_slot, dtype=torch.long))

        chunks: list[PrefillChunk] = []
        row = len(batch.decode)
        for s in batch.prefill:
            n, start = s.num_new_tokens, s.start_position
            ctx = start + n
            block_ids = torch.tensor(tables[s.request_id][: -(-ctx // tpb)], dtype=torch.long)
            pos = torch.arange(start, ctx, dtype=torch.long)
            ids.extend(s.token_ids())
            positions.append(pos)
            k_slots.append(block_ids[pos // tpb] * 2 * tpb + pos % tpb)
            mask = None if start == 0 else bottom_right_causal_mask(n, ctx)
            chunks.append(PrefillChunk(row, n, ctx, block_ids, mask))
            if s.draft or s.seq.sampling.prompt_logprobs is not None:
                keep.extend(range(row, row + n))  # every row: drafts, or prompt logprobs
            elif s.samples:
                keep.append(row + n - 1)
            row += n

        meta = self._metadata(kv_cache, torch.cat(k_slots), decode_tables, decode_ctx, chunks)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.cat(positions).to(dev),
            meta,
            torch.tensor(keep, dtype=torch.long, device=dev),
        )

    def _metadata(
        self,
        kv_cache: KVCacheManager,
        k_slots: torch.Tensor,
        decode_tables: list[list[int]],
        decode_ctx: list[int],
        chunks: list[PrefillChunk],
    ) -> PagedAttentionMetadata:
        tpb = kv_cache.tokens_per_block
        dev = self.device
        nd = len(decode_tables)
        tables_t: torch.Tensor | None = None
        mask: torch.Tensor | None = None
        if nd:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            tables_t = torch.tensor(padded, dtype=torch.long, device=dev)
            if nd > 1:
                ctx = torch.tensor(decode_ctx, dtype=torch.long, device=dev)
                mask = torch.arange(width * tpb, device=dev)[None, :] < ctx[:, None]
                mask = mask[:, None, None, :]
        k_slots = k_slots.to(dev)
        kernel = self._kernel_rows(decode_tables, decode_ctx, chunks) if self.in_place else None
        chunk_blocks = max((len(c.block_ids) for c in chunks if c.mask is not None), default=0)
        need = 0
        if kernel is None:  # the gather path's workspace
            need = workspace_numel(
                nd * (tables_t.shape[1] if tables_t is not None else 0),
                chunk_blocks,
                tpb,
                kv_cache.layout.kv_heads_per_rank,
                self.head_dim,
            )
        pool = kv_cache.shard(self.rank)
        return PagedAttentionMetadata(
            pool=pool,
            k_slots=k_slots,
            v_slots=k_slots + tpb,
            num_decode=nd,
            decode_block_tables=tables_t,
            decode_mask=mask,
            decode_ctx_len=decode_ctx[0] if nd == 1 else 0,
            prefill=tuple(
                PrefillChunk(
                    c.q_start,
                    c.q_len,
                    c.ctx_len,
                    c.block_ids.to(dev),
                    None if c.mask is None else c.mask.to(dev),
                )
                for c in chunks
            ),
            workspace=self._workspace_for(pool, need) if need else None,
            kernel=kernel,
        )

    @staticmethod
    def _kernel_rows(
        decode_tables: list[list[int]], decode_ctx: list[int], chunks: list[PrefillChunk]
    ) -> KernelRows | None:
        """The in-place kernel's part of a step: the decode rows (one each) and the continued
        chunks, in step order; None when the step has neither."""
        tables = list(decode_tables)
        ctx, q_lens = list(decode_ctx), [1] * len(decode_tables)
        rows = list(range(len(decode_tables)))
        for c in chunks:
            if c.mask is not None:
                tables.append(c.block_ids.tolist())
                ctx.append(c.ctx_len)
                q_lens.append(c.q_len)
                rows.extend(range(c.q_start, c.q_start + c.q_len))
        if not tables:
            return None
        width = max(len(t) for t in tables)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        contiguous = rows == list(range(len(rows)))
        return KernelRows(
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
            torch.tensor(starts, dtype=torch.long),
            torch.tensor(ctx, dtype=torch.long),
            None if contiguous else torch.tensor(rows, dtype=torch.long),
            len(rows),
        )

    def _workspace_for(self, pool: torch.Tensor, numel: int) -> torch.Tensor:
        """The attention gather workspace (:attr:`PagedAttentionMetadata.workspace`): at least
        ``numel`` elements of the pool's dtype. It grows by doubling (contexts grow a block at a
        time, each growth is a fresh, page-faulting allocation) and keeps its largest size: at
        most twice the largest step's K/V gathers, which eager attention used to allocate anew in
        every layer."""
        ws = self._workspace
        if ws is None or ws.dtype != pool.dtype or ws.device != pool.device:
            ws = None
        if ws is None or ws.numel() < numel:
            size = max(numel, 2 * ws.numel() if ws is not None else 0)
            self._workspace = None  # release the old one first
            ws = self._workspace = torch.empty(size, dtype=pool.dtype, device=pool.device)
        return ws


def check_w8a8(device: torch.device, dtype: torch.dtype, tp_size: int) -> None:
    """Raise ConfigError unless ``--quantization w8a8`` can run here: a CPU worker of one rank
    whose dtype oneDNN prepacks (:func:`~pdserve.workers.engine.model.compile.can_prepack`)."""
    if tp_size > 1:
        raise ConfigError("--quantization w8a8 with --tensor-parallel-size > 1 is not supported")
    if not can_prepack(device, dtype):
        raise ConfigError(
            f"--quantization w8a8 needs a CPU worker whose dtype oneDNN supports here "
            f"(device {device.type}, dtype {str(dtype).removeprefix('torch.')})"
        )
    log.info(
        "weights quantized to int8 with int8 activations (W8A8, oneDNN; the LM head stays %s)",
        str(dtype).removeprefix("torch."),
    )


def quantize_int8(model: torch.nn.Module, tp_size: int) -> None:
    """Weight-only int8 for every ``nn.Linear`` of ``model`` but the LM head, in place
    (torchao's ``Int8WeightOnlyConfig``: per-channel scales, activations stay in the model
    dtype). Raises ConfigError when torchao is missing or the worker is tensor parallel (the
    sharding slices float weights)."""
    if tp_size > 1:
        raise ConfigError("--quantization int8 with --tensor-parallel-size > 1 is not supported")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ConfigError(
            f"--quantization int8 needs torchao: pip install 'pdserve[int8]' ({exc})"
        ) from exc
    head = getattr(model, "lm_head", None)

    def keep(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module is not head

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=keep)
    log.info("weights quantized to int8 (weight-only; the LM head stays %s)", model.dtype)


def rank_main(cfg: EngineConfig, rank: int, store_path: str, pipe: Connection) -> None:
    """Rank ``rank`` (>= 1): load and shard the model, join the group through rank 0's store
    at ``store_path`` (:func:`~pdserve.workers.engine.model.parallel.open_store`), then run every step
    rank 0 sends until the pipe closes. Exits non-zero on any failure (rank 0's watchdog
    notices)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s"
    )
    try:
        runner = ModelRunner(cfg, rank=rank)
    except ConfigError as exc:
        pipe.send(("config_error", str(exc)))
        raise SystemExit(2) from exc
    except Exception as exc:
        log.exception("rank %d failed to load", rank)
        pipe.send(("error", repr(exc)))
        raise SystemExit(1) from exc
    pipe.send(("loaded", None))  # rank 0 forms the group once every rank has loaded
    try:
        size = cfg.model.tensor_parallel_size
        runner.tp_group.group = parallel.new_group(
            parallel.open_store(Path(store_path), size), rank, size
        )
    except Exception:
        log.exception("rank %d could not join the group", rank)
        raise SystemExit(1) from None
    try:
        pool: torch.Tensor = pipe.recv()
        shard = pool[rank]
        while True:
            step = parallel.decode_step(pipe.recv_bytes())
            runner.run_rank_step(step, shard)
    except EOFError:  # rank 0 closed the pipe or exited: stop
        return
    except Exception:
        log.exception("rank %d: step failed", rank)
        os._exit(1)


def kept_rows(batch: ScheduledBatch) -> tuple[list[int], list[tuple[ScheduledSequence, int]]]:
    """Where :meth:`ModelRunner.execute`'s logits rows belong: the rows of each sampling
    sequence (in ``batch.sampling`` order; one each, ``num_rows`` for a sequence with drafts)
    and, for each prefill chunk of a request asking for prompt logprobs, ``(chunk, first row)``
    (its ``num_new_tokens`` rows follow in position order)."""
    sampling: list[int] = list(range(len(batch.decode)))
    prompt: list[tuple[ScheduledSequence, int]] = []
    row = len(batch.decode)
    for s in batch.prefill:
        if s.draft:  # speculative: every fed row samples
            sampling.extend(range(row, row + s.num_new_tokens))
            row += s.num_new_tokens
        elif s.seq.sampling.prompt_logprobs is not None:
            prompt.append((s, row))
            row += s.num_new_tokens
            if s.samples:
                sampling.append(row - 1)
        elif s.samples:
            sampling.append(row)
            row += 1
    return sampling, prompt


def model_digest(model_path: Path) -> str:
    """12 hex digits of the model folder's ``config.json`` (sorted keys): part of the KV
    layout's model name, so two workers only exchange blocks of the same architecture."""
    config = json.loads((model_path / "config.json").read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
