"""The model's sampling defaults (``generation_config.json``, ``--generation-config``): read,
checked, applied to what a request leaves out, never over what it sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import ModelSettings
from pdserve.errors import ConfigError
from pdserve.protocol import Role
from pdserve.server.chat.sampling_defaults import FILE, OPENAI_DEFAULTS, SamplingDefaults
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

REPLY = [(72, "H"), (105, "i")]
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
CARD = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "bos_token_id": 1}


def _folder(tmp_path: Path, generation: dict[str, Any] | None) -> Path:
    folder = build_tokenizer_dir(tmp_path / "model")
    if generation is not None:
        (folder / FILE).write_text(json.dumps(generation))
    return folder


def test_the_fields_the_file_sets_are_the_defaults(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {**CARD, "top_k": 40, "repetition_penalty": 1.1, "min_p": 0.05})
    got = SamplingDefaults.from_model(folder)
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (0.2, 0.9, 40, 0.05)
    assert got.repetition_penalty == 1.1 and got.source == str(folder / FILE)
    assert "temperature 0.2, top_p 0.9" in got.describe()
    assert SamplingDefaults.from_model(folder, "none") == OPENAI_DEFAULTS


@pytest.mark.parametrize("generation", [None, {"bos_token_id": 1, "eos_token_id": 2}])
def test_no_file_or_no_sampling_fields_leave_openais_defaults(
    tmp_path: Path, generation: dict[str, Any] | None
) -> None:
    got = SamplingDefaults.from_model(_folder(tmp_path, generation))
    assert got == OPENAI_DEFAULTS and got.changed() == {}
    assert got.describe() == "sampling defaults: OpenAI's (temperature 1, top_p 1)"


@pytest.mark.parametrize(
    ("generation", "match"),
    [
        ({"temperature": 3.0}, r"temperature 3.0 lies outside \[0.0, 2.0\]"),
        ({"top_p": "high"}, "top_p must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"repetition_penalty": 0}, "repetition_penalty 0 lies outside"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_a_bad_file_is_a_config_error_naming_it(
    tmp_path: Path, generation: Any, match: str
) -> None:
    folder = _folder(tmp_path, {})
    (folder / FILE).write_text(json.dumps(generation))
    with pytest.raises(ConfigError, match=match):
        SamplingDefaults.from_model(folder)
    (folder / FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        SamplingDefaults.from_model(folder)


async def _sampled(folder: Path, body: dict[str, Any], mode: str = "auto") -> Any:
    cfg = RouterConfig(
        model_path=folder, served_model_name=MODEL, model=ModelSettings(generation_config=mode)
    )
    workers = [FakeWorker("p0", Role.PREFILL, REPLY), FakeWorker("d0", Role.DECODE, REPLY)]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    return h.workers["p0"].contexts[0].sampling


async def test_a_request_that_leaves_sampling_out_gets_the_models_defaults(
    tmp_path: Path,
) -> None:
    folder = _folder(tmp_path, {**CARD, "top_k": 40})
    got = await _sampled(folder, CHAT)
    assert (got.temperature, got.top_p, got.top_k) == (0.2, 0.9, 40)
    sent = await _sampled(folder, {**CHAT, "temperature": 0, "top_p": 1.0, "top_k": -1})
    assert (sent.temperature, sent.top_p, sent.top_k) == (0.0, 1.0, 0)  # the request's own
    plain = await _sampled(folder, CHAT, mode="none")
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


async def test_a_responses_object_echoes_the_effective_defaults(tmp_path: Path) -> None:
    cfg = RouterConfig(model_path=_folder(tmp_path, CARD), served_model_name=MODEL)
    workers = [FakeWorker("p0", Role.PREFILL, REPLY), FakeWorker("d0", Role.DECODE, REPLY)]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/responses", json={"model": MODEL, "input": "hello"})
    assert r.status_code == 200, r.text
    assert (r.json()["temperature"], r.json()["top_p"]) == (0.2, 0.9)
    assert h.workers["p0"].contexts[0].sampling.temperature == 0.2


def test_the_default_model_ships_its_model_cards_sampling(smollm2_dir: Path) -> None:
    """The converted SmolLM2 carries the model card's temperature 0.2 / top_p 0.9 (and
    repetition_penalty 1.1: pdserve.models.SMOLLM2_SAMPLING says why) and declares the upstream
    checkpoint's bfloat16."""
    got = SamplingDefaults.from_model(smollm2_dir)
    assert (got.temperature, got.top_p, got.repetition_penalty) == (0.2, 0.9, 1.1)
    assert json.loads((smollm2_dir / "config.json").read_text())["dtype"] == "bfloat16"
