"""Helpers for the engine integration tests: run requests to completion, HF references, the
prefill -> decode split with a byte-level block copy as the transfer path would do it."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config.loading import EngineConfig
from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings
from pdserve.protocol import FinishReason, SamplingParams
from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest

_SECTIONS = {"model": ModelSettings, "kv_cache": KVCacheSettings, "scheduler": SchedulerSettings}


def engine_config(model_dir: Path, *, kv_dtype: str | None = None, **flat: object) -> EngineConfig:
    """An EngineConfig from flat setting names (``num_blocks=64, max_num_seqs=8``): each goes
    to the one section that declares it; ``dtype`` is the model's (default: the tests' dtype,
    ``$PDSERVE_MODEL__DTYPE``: see tests/conftest.py), ``kv_dtype`` the KV pool's. Raises
    KeyError for a name no engine section declares."""
    flat = {"dtype": os.environ.get("PDSERVE_MODEL__DTYPE", "auto"), **flat}
    parts: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
    for key, value in flat.items():
        owners = [n for n, m in _SECTIONS.items() if key in m.model_fields]
        if not owners:
            raise KeyError(f"no engine setting named {key!r}")
        parts[owners[0]][key] = value  # "dtype": model comes first
    if kv_dtype is not None:
        parts["kv_cache"]["dtype"] = kv_dtype
    sections = {name: _SECTIONS[name].model_validate(v) for name, v in parts.items()}
    return EngineConfig(model_path=model_dir, **sections)  # type: ignore[arg-type]


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    settings: dict[str, object] = {"tokens_per_block": 4, "num_blocks": 512, "max_num_seqs": 8}
    settings.update(overrides)
    engine = Engine(engine_config(model_dir, **settings))  # type: ignore[arg-type]
    engine.start()
    return engine


def run(
    engine: Engine, reqs: list[EngineRequest], timeout: float = 120.0
) -> dict[str, list[EngineOutput]]:
    """Submit ``reqs`` together; return each request's outputs once all ended (a finish_reason
    for each of its ``n`` choices, or the single parked output of prefill mode)."""
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in reqs}
    ends = {
        r.request_id: r.sampling.n if r.mode == "full" and r.resume is None else 1 for r in reqs
    }
    left = [sum(ends.values())]
    lock, done = threading.Lock(), threading.Event()

    def sink(out: EngineOutput) -> None:
        with lock:
            outs[out.request_id].append(out)
            rid = out.request_id
            if out.parked_block_ids is not None:
                left[0] -= ends[rid]
                ends[rid] = 0
            elif out.finish_reason is not None and ends[rid] > 0:
                left[0] -= 1
                ends[rid] -= 1
            if left[0] == 0:
                done.set()

    for req in reqs:
        engine.add_request(req, sink)
    assert done.wait(timeout), f"requests did not finish in {timeout} s"
    return outs


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None


def joined(outs: list[EngineOutput]) -> Completion:
    return Completion(
        [t for o in outs for t in o.token_ids],
        "".join(o.text for o in outs),
        outs[-1].finish_reason,
    )


def complete(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams) -> Completion:
    return joined(run(engine, [EngineRequest(rid, prompt, sampling)])[rid])


def copy_blocks_bytewise(
    src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int]
) -> None:
    """Copy K/V block by block and layer by layer as raw bytes, at the byte offsets
    ``docs/architecture/workers.md`` gives: ((layer * num_blocks) + block) * block_bytes_per_layer."""
    layout = src.layout
    size = layout.block_bytes_per_layer
    src_bytes = src.kv_cache.pool.view(-1).view(torch.uint8)
    dst_bytes = dst.kv_cache.pool.view(-1).view(torch.uint8)
    n_src, n_dst = src.kv_cache.num_blocks, dst.kv_cache.num_blocks
    for layer in range(layout.num_layers):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            a, b = ((layer * n_src) + s) * size, ((layer * n_dst) + d) * size
            dst_bytes[b : b + size] = src_bytes[a : a + size]


def split_complete(
    prefill: Engine, decode: Engine, rid: str, prompt: list[int], sampling: SamplingParams
) -> Completion:
    """Prefill leg on ``prefill`` (parks the blocks), reserve + copy + resume on ``decode``.
    Raises AssertionError naming the leg when an output carries an engine error."""
    outs = run(prefill, [EngineRequest(rid, prompt, sampling, mode="prefill")])[rid]
    _no_errors(outs, "prefill")
    (first,) = outs
    assert len(first.token_ids) == 1
    if first.finish_reason is not None:
        assert first.parked_block_ids is None
        return joined([first])
    assert first.parked_block_ids is not None
    dst = decode.reserve(rid, prompt, sampling).block_ids
    copy_blocks_bytewise(prefill, first.parked_block_ids, decode, dst)
    prefill.free_parked(rid)
    resume = EngineRequest(rid, prompt, sampling, mode="resume", first_token=first.token_ids[0])
    rest = run(decode, [resume])[rid]
    _no_errors(rest, "decode")
    return joined([first, *rest])


def _no_errors(outs: list[EngineOutput], leg: str) -> None:
    for out in outs:
        if out.error is not None:
            raise AssertionError(f"{leg} leg failed: {out.error}")


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' own greedy generate(); stops at the model's EOS like the engine. Plain
    greedy: a repetition penalty in the model's generation_config.json (the default model's
    1.1) is turned off, as the engine's greedy requests send none."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=1.0,
        )
    return out[0, len(prompt) :].tolist()


TINY_TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "pdserve splits prefill and decode across workers; " * 3,
    "x",
    "0123456789abcdef",  # exactly four blocks of four tokens
]


def tiny_prompts(tok) -> list[list[int]]:  # noqa: ANN001
    """:data:`TINY_TEXTS` and one chat-templated message as token ids of ``tok``."""
    prompts = [tok.encode(t, add_special_tokens=False) for t in TINY_TEXTS]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=False
    )
    return [*prompts, tok.encode(chat, add_special_tokens=False)]


PROMPT_LENGTHS = (3, 17, 30, 45, 61)


def mixed_cases(vocab: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of different lengths (tables grow across width buckets with 4-token blocks);
    different ``max_tokens`` so the batch shrinks through the buckets; one seeded sample."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        if i == 2:
            sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=14, ignore_eos=True)
        else:
            sampling = SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True)
        cases.append((prompt, sampling))
    return cases


def check_batched_equals_solo(
    graphed: Engine, eager: Engine, cases: list[tuple[list[int], SamplingParams]]
) -> list[list[int]]:
    """Run ``cases`` together on ``graphed`` and one by one on ``eager``; assert equal tokens
    and that ``graphed`` freed every block. Returns the batched token ids."""
    solo = [complete(eager, f"solo-{i}", p, s).token_ids for i, (p, s) in enumerate(cases)]
    reqs = [EngineRequest(f"batch-{i}", p, s) for i, (p, s) in enumerate(cases)]
    outs = run(graphed, reqs)
    batched = [joined(outs[f"batch-{i}"]).token_ids for i in range(len(cases))]
    for i, (got, want) in enumerate(zip(batched, solo, strict=True)):
        assert len(got) == cases[i][1].max_tokens, i
        assert got == want, f"case {i} (prompt {len(cases[i][0])} tokens)"
    assert graphed.kv_cache.get_num_free_blocks() == graphed.kv_cache.num_blocks
    return batched


BF16_LOGIT_STEP = 0.125
"""bfloat16's spacing for logits in [16, 32), SmolLM2's range for its top tokens: bfloat16 keeps
8 significant bits, so two logits that float32 tells apart by less than this may round to the
same value or swap."""


def check_within_bf16_resolution(
    hf: torch.nn.Module, prompt: list[int], got: list[int], logprobs: list[float], what: str
) -> None:
    """Assert that a greedy answer ``got`` (token ids, with the server's ``logprobs`` of them)
    is what transformers' bfloat16 model ``hf`` would choose, up to bfloat16's resolution:
    teacher-forced along ``prompt + got``, each token within 2 :data:`BF16_LOGIT_STEP` of the
    top logprob, and its logprob within 4 steps of transformers'. Why not token for token: see
    tests/integration/test_engine_fidelity.py's bfloat16 test. ``what`` names the case."""
    assert len(logprobs) == len(got) > 0, what
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    chosen = ref[torch.arange(len(got)), torch.tensor(got)]
    gap = ref.max(dim=-1).values - chosen
    assert float(gap.max()) <= 2 * BF16_LOGIT_STEP, (what, gap.tolist())
    delta = (chosen - torch.tensor(logprobs, dtype=torch.float32)).abs()
    assert float(delta.max()) <= 4 * BF16_LOGIT_STEP, (what, delta.tolist())
