"""Tensor parallel ranks of one worker: the model's sharding, the rank processes, the step fan-out.

Design origin: Megatron-LM's column/row parallel split of a transformer layer, as vLLM shards
Llama-family models, and vLLM's executor pattern: one scheduler (rank 0, the worker process)
decides each step, every rank executes the same step on its shard, and the row-parallel layers'
partial sums are all-reduced over ``torch.distributed`` (gloo on CPU). Rank layout of a worker
with ``tensor_parallel_size`` N (docs/architecture/workers.md, "Tensor parallel workers")::

    worker process = rank 0                     rank 1 .. N-1: spawned processes
      HTTP, scheduler, sampler, transfer          model shard, no scheduler, no HTTP
      model shard (heads/ffn of rank 0)           step = pipe.recv_bytes(); forward(step)
      step -> pipe to every rank  ------------>   (logits discarded: rank 0 samples)
      forward; all_reduce after o_proj/down_proj <-> same collectives (gloo process group)
      KV pool: one shared-memory buffer of N shards, rank r writes only shard r
      [N, L, num_blocks, 2, tpb, kv_heads_per_rank, hd] (KVLayout.tp_size = N)

Sharding of each decoder layer (column = output rows split, row = input columns split and the
outputs all-reduced; embeddings, norms and the LM head stay whole on every rank):

    q_proj  column: rank r keeps query heads [r*H/N, (r+1)*H/N)
    k_proj, v_proj  column: the KV heads :meth:`KVLayout.rank_heads` gives rank r
                    (KV heads fewer than ranks: each rank keeps the one its query heads use)
    o_proj  row   + all_reduce          gate_proj, up_proj  column      down_proj  row + all_reduce

Why our own sharding rather than transformers' ``tp_plan``: the plan shards ``k_proj``/``v_proj``
column-wise only when the ranks divide the KV heads (SmolLM2's 3 KV heads over 4 ranks have no
plan), goes through DTensor, and launches through ``torchrun``; the runner already owns the
forward and the layers to split are seven linears per layer. Every rank loads the full
checkpoint and drops what it does not keep (simple; fine for the models one host serves).

Rendezvous: the ranks meet through a ``torch.distributed.FileStore`` in a private folder rank 0
makes (``mkdtemp``: mode 0700, removed on :meth:`RankGroup.close`), whose path reaches the ranks
in their spawn arguments (a pipe, never a command line), not a ``TCPStore``: a TCPStore's
server listens on every interface whatever host it is given, and answers anyone unauthenticated
(``list_keys`` included). Gloo's pair listeners bind to 127.0.0.1 (:func:`new_group`). What is
left open: a local user can still connect to those loopback listeners while the group forms.

Steps go to the ranks through pipes (inputs and attention metadata, a few KiB, as plain
tensors and numbers that ``torch.load(weights_only=True)`` reads: no code runs) rather
than a collective, so idle ranks wait without a collective timeout and a dead rank 0 ends them
(EOF). A rank that dies is noticed by rank 0's watchdog: the group is marked failed, every later
step raises :class:`RankFailedError`, and ``on_death`` runs (the worker process stops itself,
and the supervisor restarts it).
"""

from __future__ import annotations

import datetime
import io
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from pdserve.errors import ConfigError, PdserveError
from pdserve.protocol import rank_kv_heads

if TYPE_CHECKING:
    from pdserve.config.loading import EngineConfig
    from pdserve.workers.engine.model.attention import PagedAttentionMetadata

log = logging.getLogger(__name__)

GROUP_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a collective (and the group's rendezvous at start-up) waits for the other ranks."""
READY_TIMEOUT_S = 600.0
"""How long rank 0 waits for every rank to load its shard."""


class RankFailedError(PdserveError):
    """A tensor parallel rank of this worker died or failed: the worker cannot run steps."""


def check_shardable(text_config: Any, tp: int, path: object) -> None:
    """Raise ConfigError unless ``tp`` ranks split the model's query heads, KV heads (one
    divides the other) and MLP width; e.g. SmolLM2's 9 query heads over 2 ranks."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    ffn = getattr(text_config, "intermediate_size", 0)
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"{kv_heads} KV heads (neither divides the other)")
    if ffn % tp:
        problems.append(f"intermediate size {ffn}")
    if problems:
        raise ConfigError(
            f"{path}: tensor_parallel_size {tp} does not divide the model's "
            f"{', '.join(problems)}; pick a tensor parallel size that divides them"
        )


def _linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    found = {}
    for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, _MLP)):
        for name in names:
            mod = getattr(owner, name, None) if owner is not None else None
            if not isinstance(mod, torch.nn.Linear):
                raise ConfigError(
                    f"tensor parallel needs Llama-style decoder layers (self_attn.{{q,k,v,o}}_proj, "
                    f"mlp.{{gate,up,down}}_proj); {type(layer).__name__} has no {name}"
                )
            found[name] = mod
    return found


_MLP = ("gate_proj", "up_proj", "down_proj")


def _keep_rows(linear: torch.nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = int(rows.numel())


def _keep_cols(linear: torch.nn.Linear, cols: torch.Tensor, keep_bias: bool) -> None:
    weight = linear.weight.detach()[:, cols].clone()
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None and not keep_bias:  # the bias is added once, after the sum
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = int(cols.numel())


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


class GroupRef:
    """The process group a rank's all-reduce hooks use, set once the group is formed."""

    group: Any = None


def shard_model(
    model: Any, tp: int, rank: int, head_dim: int, num_kv_heads: int, ref: GroupRef
) -> None:
    """Cut ``model`` (a loaded transformers causal LM, checked by :func:`check_shardable`)
    down to rank ``rank``'s shard of ``tp`` in place (the table of the module docstring) and
    hook an all-reduce over ``ref.group`` after each row-parallel linear. Raises ConfigError
    for layers it cannot split."""
    text = model.config.get_text_config()
    hd = head_dim
    q_per_rank = text.num_attention_heads // tp
    q_rows = _head_rows(range(rank * q_per_rank, (rank + 1) * q_per_rank), hd)
    kv_rows = _head_rows(rank_kv_heads(num_kv_heads, tp, rank), hd)
    ffn = text.intermediate_size // tp
    ffn_rows = torch.arange(rank * ffn, (rank + 1) * ffn)

    def all_reduce(_mod: torch.nn.Module, _inp: object, out: torch.Tensor) -> torch.Tensor:
        ref.group.allreduce([out]).wait()
        return out

    for layer in model.model.layers:
        lin = _linears(layer)
        _keep_rows(lin["q_proj"], q_rows)
        _keep_rows(lin["k_proj"], kv_rows)
        _keep_rows(lin["v_proj"], kv_rows)
        _keep_cols(lin["o_proj"], q_rows, keep_bias=rank == 0)
        _keep_rows(lin["gate_proj"], ffn_rows)
        _keep_rows(lin["up_proj"], ffn_rows)
        _keep_cols(lin["down_proj"], ffn_rows, keep_bias=rank == 0)
        lin["o_proj"].register_forward_hook(all_reduce)
        lin["down_proj"].register_forward_hook(all_reduce)


STORE_FILE = "store"
"""The FileStore's file in the rendezvous folder (:func:`rendezvous_dir`)."""
GLOO_HOST = "127.0.0.1"
"""Where the gloo pair listeners bind: the ranks of a worker share one host."""


def rendezvous_dir() -> Path:
    """A fresh private folder (mode 0700) for one rank group's store; the caller removes it."""
    return Path(tempfile.mkdtemp(prefix="pdserve-tp-"))


def open_store(path: Path, size: int) -> Store:
    """The rendezvous store of a worker's ``size`` ranks: a FileStore at ``path`` (module
    docstring, "Rendezvous"), which only this user can open; every rank opens the same path.
    No socket listens for it."""
    file_store: Any = dist.FileStore  # type: ignore[attr-defined]  # exported, not declared so
    store = file_store(str(path), size)
    store.set_timeout(GROUP_TIMEOUT)
    return store  # type: ignore[no-any-return]


def new_group(store: Store, rank: int, size: int) -> Any:
    """A gloo process group of its own (not the process-global default group, so several
    workers' engines can live in one process, e.g. tests), its pair listeners on loopback
    (:data:`GLOO_HOST`; gloo's default binds the address the host name resolves to). Blocks
    until every rank joined."""
    gloo: Any = ProcessGroupGloo  # its options class is missing from torch's stubs
    opts = gloo._Options()
    opts._timeout = GROUP_TIMEOUT
    opts._devices = [gloo.create_device(hostname=GLOO_HOST)]
    return ProcessGroupGloo(PrefixStore("pdserve-tp", store), rank, size, opts)


@dataclass(frozen=True)
class Step:
    """What every rank runs for one step: flattened inputs (``ids``, ``positions``: ``[T]``
    long), the attention metadata without pool or workspace (each rank has its own), and the
    workspace elements the step needs (0: none)."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedAttentionMetadata
    workspace_numel: int


class RankGroup:
    """Rank 0's side of a tensor parallel worker: spawns ranks 1..N-1 (each loads and shards
    the model in ``target``), forms the gloo group with them, lends them the KV pool
    once, sends them every step, watches them.

    Thread-safety: :meth:`run_step` from the engine thread only; ``on_death`` runs on the
    watchdog thread. Raises RankFailedError (a rank died or failed to start) and ConfigError
    (a rank found the model unshardable) from :meth:`join`."""

    def __init__(self, cfg: EngineConfig, target: Callable[..., None]) -> None:
        """Start ranks 1..N-1 as spawned processes running ``target(cfg, rank, store_path,
        pipe)`` (:func:`pdserve.workers.engine.model.model_runner.rank_main`); ``store_path`` (a
        ``str``) travels in the spawn arguments, never on a command line."""
        import torch.multiprocessing as tmp  # registers the shared-memory tensor pickling

        self.size = cfg.model.tensor_parallel_size
        self.on_death: Callable[[str], None] | None = None
        self.failure: str | None = None
        self._closing = False
        self._pool: torch.Tensor | None = None
        self._pipes: list[Connection] = []
        self._procs: list[Any] = []
        self.store_dir = rendezvous_dir()
        try:
            self.store_path = self.store_dir / STORE_FILE
            self.store = open_store(self.store_path, self.size)
            ctx = tmp.get_context("spawn")
            for rank in range(1, self.size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=target,
                    args=(cfg, rank, str(self.store_path), theirs),
                    name=f"pdserve-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._pipes.append(ours)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise
        log.info(
            "tensor parallel: started ranks 1-%d (pids %s)",
            self.size - 1,
            [p.pid for p in self._procs],
        )
        self.group: Any = None

    def join(self) -> Any:
        """Wait until every rank has loaded its shard (a rank that fails to load is reported
        at once), then form the process group with them; returns the group (rank 0's
        all-reduce hooks use it)."""
        for rank, pipe in enumerate(self._pipes, start=1):
            if not pipe.poll(READY_TIMEOUT_S):
                raise RankFailedError(
                    f"tensor parallel rank {rank} did not load within {READY_TIMEOUT_S:.0f} s"
                )
            try:
                kind, detail = pipe.recv()
            except EOFError:
                raise RankFailedError(f"tensor parallel rank {rank} exited while loading") from None
            if kind == "config_error":
                raise ConfigError(detail)
            if kind != "loaded":
                raise RankFailedError(f"tensor parallel rank {rank} failed to start: {detail}")
        self.group = new_group(self.store, 0, self.size)  # every rank is joining it now
        threading.Thread(target=self._watch, name="pdserve-tp-watchdog", daemon=True).start()
        return self.group

    def run_step(self, step: Step, pool: torch.Tensor) -> None:
        """Send ``step`` to every rank (and the shared ``pool``, the first time: each rank
        keeps its shard). Raises RankFailedError when a rank is gone."""
        if self.failure is not None:
            raise RankFailedError(self.failure)
        try:
            if pool is not self._pool:
                for pipe in self._pipes:
                    pipe.send(pool)  # shared memory: the ranks map the same pages
                self._pool = pool
            payload = encode_step(step)
            for pipe in self._pipes:
                pipe.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise RankFailedError(f"a tensor parallel rank is gone: {exc!r}") from exc

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(1.0)
        self.failure = (
            f"tensor parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        )
        log.error("%s: this worker cannot run steps any more", self.failure)
        if self.on_death is not None:
            self.on_death(self.failure)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every rank (idempotent): closing the pipes ends their loops; then remove the
        rendezvous folder."""
        self._closing = True
        for pipe in self._pipes:
            pipe.close()
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        shutil.rmtree(self.store_dir, ignore_errors=True)


def encode_step(step: Step) -> bytes:
    """``step`` as bytes of plain tensors, numbers and lists (:func:`decode_step` reads them
    with ``torch.load(weights_only=True)``, which builds no other object)."""
    m, k = step.meta, step.meta.kernel
    chunks = [[c.q_start, c.q_len, c.ctx_len, c.block_ids, c.mask] for c in m.prefill]
    kernel = None if k is None else [k.block_tables, k.query_start, k.ctx_lens, k.rows, k.num_rows]
    meta = [m.pool, m.k_slots, m.v_slots, m.num_decode, m.decode_block_tables, m.decode_mask,
            m.decode_ctx_len, chunks, m.write_rows, kernel]  # fmt: skip
    buf = io.BytesIO()
    torch.save([step.ids, step.positions, meta, step.workspace_numel], buf)
    return buf.getvalue()


def decode_step(data: bytes) -> Step:
    """The :class:`Step` :func:`encode_step` wrote. Raises what ``torch.load`` raises for
    anything but its plain types."""
    from pdserve.workers.engine.model.attention import (
        KernelRows,
        PagedAttentionMetadata,
        PrefillChunk,
    )

    ids, positions, meta, workspace = torch.load(io.BytesIO(data), weights_only=True)
    pool, k_slots, v_slots, nd, tables, mask, ctx, chunks, write_rows, kernel = meta
    prefill = tuple(PrefillChunk(*c) for c in chunks)
    rows = None if kernel is None else KernelRows(*kernel)
    bare = PagedAttentionMetadata(
        pool, k_slots, v_slots, nd, tables, mask, ctx, prefill, write_rows, kernel=rows
    )
    return Step(ids, positions, bare, int(workspace))


def step_for_ranks(
    ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
) -> Step:
    """The :class:`Step` of rank 0's inputs: the metadata travels without the pool and the
    workspace (an empty tensor in the pool's place; each rank substitutes its own shard)."""
    ws = meta.workspace.numel() if meta.workspace is not None else 0
    bare = replace(meta, pool=torch.empty(0, dtype=meta.pool.dtype), workspace=None)
    return Step(ids.cpu(), positions.cpu(), bare, ws)
