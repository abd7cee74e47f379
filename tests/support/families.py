"""Decoder families for the fidelity tests: one tiny random model per family
(:func:`pdserve.bench.engine.bench_models.build_random_model`, byte tokenizer, the family's own
features on), built once per session, and the transformers reference to compare with.

The engine tests (``tests/integration/test_engine_families.py``) and the stack tests
(``tests/e2e/test_stack_families.py``) compare greedy tokens with transformers' own
``generate()`` over the same weights, and their logprobs within :data:`LOGPROB_TOLERANCE`
(greedy tokens alone cannot see a monotonic change of the logits such as Gemma 2's final
soft-capping or Granite's ``logits_scaling``). Generation ignores EOS on both sides
(:data:`GREEDY`, :func:`hf_reference`): some tiny models emit EOS early, and every compared
token is then one more step of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.bench.engine.bench_models import FAMILY_ARCH, build_random_model
from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine
from tests.support.engine import Completion, split_complete, tiny_prompts

FAMILIES: tuple[str, ...] = tuple(FAMILY_ARCH)
"""Family names (keys of :data:`pdserve.bench.engine.bench_models.FAMILY_ARCH`)."""
MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
GREEDY_LOGPROBS = GREEDY.model_copy(update={"logprobs": True})
SLIDING_WINDOW = 8
"""The tiny models' sliding window (where the family has one): most prompts are longer."""

_BUILT: dict[str, Path] = {}
_HF: dict[Path, Any] = {}


def family_model_dir(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    """The tiny random model of ``family`` (built on first use, once per session)."""
    if family not in _BUILT:
        path = tmp_path_factory.mktemp(f"family-{family}")
        _BUILT[family] = build_random_model(path, family, seed=0)
    return _BUILT[family]


def hf_model(model_dir: Path, **config: Any) -> Any:
    """transformers' model of ``model_dir`` (AutoModelForCausalLM, its default attention
    implementation, float32, eval), loaded once per session; with ``config``, those config
    fields changed first (a fresh model each call, e.g. a feature of :data:`FEATURE_SWITCHES`
    turned off)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config or model_dir not in _HF:
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        for key, value in config.items():
            setattr(cfg, key, value)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=cfg, dtype=torch.float32, local_files_only=True
        ).eval()
        if config:
            return model
        _HF[model_dir] = model
    return _HF[model_dir]


def hf_reference(
    model: Any, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate()`` for exactly ``max_new_tokens`` tokens (EOS does not
    stop it: the engine's ``ignore_eos``): the tokens and each one's logprob under the model's
    raw distribution (what the engine reports)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens: list[int] = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), dim=-1)[t].item()
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


LOGPROB_TOLERANCE = 1e-3
"""How far the engine's float32 logprobs may be from transformers' (kernel order only)."""

FEATURE_SWITCHES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen2", "sliding window", {"layer_types": ["full_attention"] * 2}),
    ("qwen3", "sliding window", {"layer_types": ["full_attention"] * 2}),
    ("mistral", "sliding window", {"sliding_window": None}),
    ("phi3", "sliding window", {"sliding_window": None}),
    ("gemma2", "sliding window", {"layer_types": ["full_attention"] * 4}),
    ("gemma2", "attention soft-capping", {"attn_logit_softcapping": None}),
    ("gemma2", "final soft-capping", {"final_logit_softcapping": None}),
    ("gemma2", "query_pre_attn_scalar", {"query_pre_attn_scalar": 16}),
    ("gemma3", "sliding window", {"layer_types": ["full_attention"] * 4}),
    ("gemma3", "query_pre_attn_scalar", {"query_pre_attn_scalar": 16}),
    ("granite", "embedding_multiplier", {"embedding_multiplier": 1.0}),
    ("granite", "residual_multiplier", {"residual_multiplier": 1.0}),
    ("granite", "attention_multiplier", {"attention_multiplier": 0.25}),
    ("granite", "logits_scaling", {"logits_scaling": 1.0}),
    ("qwen3_moe", "top-2 routing", {"num_experts_per_tok": 1}),
    ("mixtral", "top-2 routing", {"num_experts_per_tok": 1}),
]
"""(family, feature, config fields that turn it off): each feature of the tiny models changes
transformers' greedy tokens or logprobs on :func:`family_prompts`, so an engine ignoring it
fails the fidelity tests (``attention_multiplier`` 0.25 is 1/sqrt(head_dim), the default
scale; ``query_pre_attn_scalar`` 16 is head_dim)."""


def family_prompts(tok: Any) -> list[list[int]]:
    """Prompts of 1 to 150 tokens (:func:`tests.support.engine.tiny_prompts`): 5, 44, 150, 1,
    16 and a chat-templated 34; four are longer than :data:`SLIDING_WINDOW`."""
    return tiny_prompts(tok)


def first_difference(got: list[Any], want: list[Any]) -> str:
    """Where two token lists (ids, or the API's token strings) part (empty when equal)."""
    if got == want:
        return ""
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        i = min(len(got), len(want))
        return f"lengths differ at token {i}: got {len(got)} tokens, want {len(want)}"
    return (
        f"first difference at token {i}: got {got[i]!r}, want {want[i]!r} (got {got}, want {want})"
    )


def mismatches(
    prompts: list[list[int]],
    got: list[tuple[list[Any], list[float] | None]],
    want: list[tuple[list[Any], list[float]]],
) -> list[str]:
    """One line per prompt whose tokens differ or (where ``got`` has logprobs) whose logprobs
    are more than :data:`LOGPROB_TOLERANCE` away, with where and by how much."""
    bad = []
    for i, (p, (tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(prompts, got, want, strict=True)
    ):
        where = f"prompt {i} ({len(p)} tokens)"
        if tokens != want_tokens:
            bad.append(f"{where}: {first_difference(tokens, want_tokens)}")
        elif logprobs is not None:
            errs = [abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)]
            worst = max(range(len(errs)), key=errs.__getitem__, default=None)
            if worst is not None and errs[worst] > LOGPROB_TOLERANCE:
                bad.append(
                    f"{where}: same tokens, logprob of token {worst} off by {errs[worst]:.3g} "
                    f"(got {logprobs[worst]:.5f}, want {want_logprobs[worst]:.5f})"
                )
    return bad


def split_greedy(
    prefill: Engine,
    decode: Engine,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams = GREEDY,
) -> Completion:
    """:func:`tests.support.engine.split_complete`, greedy by default."""
    return split_complete(prefill, decode, rid, prompt, sampling)
