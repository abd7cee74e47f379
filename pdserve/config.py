"""Configuration: built once at the edge (the CLI), validated, frozen, passed down explicitly.

Derived values are properties. Environment variables are read only in :func:`default_cache_dir`
(``PDSERVE_CACHE_DIR``) and by the CLI; constructors never read ``os.environ``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineConfig(_Cfg):
    """Engine (model runner + KV cache manager + scheduler) settings.

    ``model_path`` is a local Hugging Face model folder (config.json, safetensors, tokenizer).
    The KV pool gets ``kv_cache_bytes`` (or exactly ``num_blocks`` blocks when set), of
    ``cache_dtype`` elements (attention computes in the model dtype and casts K/V on write and
    read, so a narrower KV dtype halves the pool and the transfer at some precision).
    """

    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kv_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="KV cache storage dtype; default: the model dtype"
    )
    device: str = "cpu"
    tokens_per_block: int = Field(default=16, gt=0)
    kv_cache_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    num_blocks: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=32, gt=0, description="running sequences per step")
    max_num_batched_tokens: int = Field(default=2048, gt=0, description="tokens per forward")
    max_model_len: int | None = Field(default=None, gt=0, description="default: model's limit")
    num_threads: int | None = Field(default=None, gt=0, description="torch intra-op threads")

    @property
    def cache_dtype(self) -> str:
        """The KV pool's dtype name: ``kv_dtype``, else the model ``dtype``."""
        return self.kv_dtype or self.dtype


class TransferConfig(_Cfg):
    """KV transfer settings. ``backend='auto'`` picks NIXL where it imports, else TCP;
    ``"ucx"`` is ucxx tagged send/receive (:mod:`pdserve.transfer.ucx`)."""

    backend: Literal["auto", "nixl", "ucx", "tcp"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    timeout_s: float = Field(default=30.0, gt=0)
    ucx_devices: str | None = Field(
        default=None, description="UCX net devices of the NIXL and ucx backends, e.g. 'lo'"
    )
    integrity: bool = Field(
        default=True,
        description="decode side: ask for and check a digest of every transferred segment",
    )


class WorkerConfig(_Cfg):
    role: Literal["prefill", "decode", "colocated"]
    engine: EngineConfig
    transfer: TransferConfig = TransferConfig()
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    advertise_host: str | None = None
    discovery: str = Field(
        description="router URL (embedded registry, http://router:port), etcd://host:port or nats://host:port"
    )
    lease_s: float = Field(default=30.0, gt=0, description="how long parked KV blocks wait")
    registration_ttl_s: float = Field(default=10.0, gt=0)
    worker_id: str | None = None


class RouterConfig(_Cfg):
    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    discovery: str = Field(
        default="embedded", description="'embedded', etcd://host:port or nats://host:port"
    )
    request_timeout_s: float = Field(default=300.0, gt=0, description="deadline for both legs")
    registration_ttl_s: float = Field(default=10.0, gt=0)
    max_model_len: int | None = None
