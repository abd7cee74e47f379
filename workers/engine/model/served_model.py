"""What the engine serves of a loaded model: its context window, its end-of-sequence token ids,
its KV layout and the KV pool sized for it, each read off the
:class:`~.model_runner.ModelRunner` (and the tokenizer) once, when the engine is built.

Lengths are in tokens; the layout's ``model`` is the served name joined to the model folder's
config digest (:func:`~.model_runner.model_digest`), so peers serving another build of the
model refuse each other's KV blocks. Nothing is kept here: :func:`kv_pool` hands its
:class:`~pdserve.workers.kv.manager.KVCacheManager` (and the pool tensor it allocates on the
model's device) to the caller, the engine, which owns it from then on.
:func:`context_window` raises :class:`~pdserve.errors.ConfigError` for a ``max_model_len``
past the model's positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.config.loading import EngineConfig
from pdserve.errors import ConfigError
from pdserve.protocol import KVLayout
from pdserve.workers.engine.model.model_runner import ModelRunner, model_digest
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.kv.sizing import log_pool, pool_size


def context_window(cfg: EngineConfig, runner: ModelRunner) -> int:
    """Tokens a sequence may span (prompt + completion): ``model.max_model_len``, else the
    model's position embeddings. Raises ConfigError when the setting exceeds those."""
    limit = runner.max_position_embeddings
    if cfg.model.max_model_len is not None and cfg.model.max_model_len > limit:
        raise ConfigError(f"max_model_len {cfg.model.max_model_len} exceeds the model's {limit}")
    return cfg.model.max_model_len or limit


def eos_token_ids(runner: ModelRunner, tokenizer: Any) -> frozenset[int]:
    """The ids that end a sequence: the generation config's ``eos_token_id`` (one or a list)
    and the tokenizer's."""
    eos = runner.model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return frozenset(eos_ids)


def kv_layout(cfg: EngineConfig, runner: ModelRunner) -> KVLayout:
    """The geometry of this engine's KV pool, as peers compare it before a transfer."""
    return KVLayout(
        model=f"{cfg.served_model_name}-{model_digest(Path(cfg.model_path))}",
        num_layers=runner.num_layers,
        num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim,
        tokens_per_block=cfg.kv_cache.tokens_per_block,
        dtype=cfg.kv_cache.dtype or runner.dtype_name,
        tp_size=cfg.model.tensor_parallel_size,
    )


def kv_pool(
    cfg: EngineConfig, runner: ModelRunner, layout: KVLayout, max_model_len: int
) -> KVCacheManager:
    """The KV block pool of ``layout`` on the model's device, as many blocks as
    :func:`~pdserve.workers.kv.sizing.pool_size` gives (on CUDA: what the runner's profiled
    step leaves of ``gpu_memory_utilization``); logged once. Raises
    :class:`~pdserve.errors.CapacityError` for a budget that holds no block."""
    size = pool_size(
        layout,
        cfg.kv_cache,
        device=cfg.model.device,
        auto_bytes=runner.profile_cuda_budget(
            layout,
            min(cfg.scheduler.max_num_batched_tokens, max_model_len - 1),
            cfg.kv_cache.gpu_memory_utilization,
        )
        if cfg.model.device.startswith("cuda")
        else None,
    )
    pool = KVCacheManager(
        layout, size.num_blocks, cfg.model.device, prefix_caching=cfg.kv_cache.prefix_caching
    )
    log_pool(size, layout, max_model_len)
    return pool
