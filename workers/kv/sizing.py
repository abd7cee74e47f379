"""KV pool sizing: how many KV blocks a worker allocates when the user did not say.

Precedence (the first that is set wins):

1. ``kv_cache.num_blocks``: exactly that many blocks;
2. ``kv_cache.budget_mb``: that many MiB (``--kv-cache-mb``);
3. derived from the machine:

   - CPU (vLLM's ``VLLM_CPU_KVCACHE_SPACE`` made automatic): ``kv_cache.memory_fraction`` of the
     host memory available now (``MemAvailable``, capped by the container's cgroup limit).
     ``pdserve up`` measures once and hands each of its workers an explicit share instead, so
     workers started one after another do not see each other's pools.
   - CUDA (vLLM's ``gpu_memory_utilization``): ``kv_cache.gpu_memory_utilization x total device
     memory``, minus what this process already holds (weights) and the peak of a profiled
     largest step (``max_num_batched_tokens`` tokens of prefill).

The worker logs the outcome at start: blocks, tokens, bytes, and how many requests at a full
context window the pool holds at once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.config.settings import KVCacheSettings
from pdserve.protocol import KVLayout

log = logging.getLogger(__name__)

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
_CGROUP_USAGE = (
    Path("/sys/fs/cgroup/memory.current"),
    Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(paths: tuple[Path, ...]) -> int | None:
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def available_host_memory() -> int:
    """Bytes of host memory available to this process now: ``MemAvailable`` from
    ``/proc/meminfo``, capped by the cgroup (container) limit minus its usage. Falls back to
    ``os.sysconf`` where ``/proc/meminfo`` is missing."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, usage = _read_int(_CGROUP_LIMITS), _read_int(_CGROUP_USAGE)
    if limit is not None and limit < 1 << 60:  # "max" or a huge v1 number: no limit
        available = min(available, max(0, limit - (usage or 0)))
    return available


def cuda_kv_budget(total: int, in_use: int, peak_step: int, utilization: float) -> int:
    """vLLM's rule: ``utilization x total`` minus what the process holds (weights) and the
    profiled peak of the largest step, all in bytes; never negative."""
    return max(0, int(total * utilization) - in_use - peak_step)


@dataclass(frozen=True)
class PoolSize:
    """A pool size and how it was chosen (``source``, for the start-up log)."""

    num_blocks: int
    source: str


def pool_size(
    layout: KVLayout,
    settings: KVCacheSettings,
    *,
    device: str,
    auto_bytes: int | None = None,
) -> PoolSize:
    """Blocks for a pool of ``layout`` by the precedence of the module docstring, read from
    the ``kv_cache`` section ``settings`` whole.

    ``device``: the model's device (``cpu``, ``cuda:0``). ``auto_bytes``: the machine-derived
    budget on CUDA (from :func:`cuda_kv_budget`, measured by the model runner); on CPU it is
    derived here from :func:`available_host_memory` and ``settings.memory_fraction``.
    """
    block_bytes = layout.block_bytes  # every layer and tensor parallel rank
    if settings.num_blocks is not None:
        return PoolSize(settings.num_blocks, "num_blocks")
    if settings.budget_bytes is not None:
        return PoolSize(settings.budget_bytes // block_bytes, f"budget_mb={settings.budget_mb}")
    if device.startswith("cuda") and auto_bytes is not None:
        return PoolSize(auto_bytes // block_bytes, "gpu_memory_utilization")
    available = available_host_memory()
    fraction = settings.memory_fraction
    return PoolSize(
        int(available * fraction) // block_bytes,
        f"{fraction:.0%} of {available / 2**30:.1f} GiB available host memory",
    )


def log_pool(size: PoolSize, layout: KVLayout, max_model_len: int) -> None:
    """The start-up line: blocks, tokens, bytes, concurrency at a full window."""
    tokens = size.num_blocks * layout.tokens_per_block
    nbytes = size.num_blocks * layout.block_bytes
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.2f GiB %s (%s); holds %.1f requests "
        "at the full %d-token window",
        size.num_blocks,
        layout.tokens_per_block,
        tokens,
        nbytes / 2**30,
        layout.dtype,
        size.source,
        tokens / max_model_len,
        max_model_len,
    )
