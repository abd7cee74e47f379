"""vLLM's /tokenize and /detokenize on the router, and the chat template's options
(chat_template_kwargs, add_generation_prompt, continue_final_message)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.errors import InvalidRequestError
from pdserve.protocol import Role
from pdserve.security import SecuritySettings
from pdserve.server.chat.preprocess import Preprocessor
from pdserve.server.chat.schemas import ChatCompletionRequest
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness
from tests.support.models import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=256)


def workers() -> list[FakeWorker]:
    reply = [(72, "H"), (105, "i")]
    return [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]


async def test_tokenize_counts_a_prompt_or_the_chat_prompt_and_detokenize_inverts_it(
    model_dir: Any,
) -> None:
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    async with router_harness(cfg, workers()) as h:
        text = await h.client.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
        chat = await h.client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
        strs = await h.client.post(
            "/tokenize", json={"model": MODEL, "prompt": "hi", "return_token_strs": True}
        )
        await h.client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        sent = list(h.workers["p0"].contexts[0].prompt_token_ids)
        back = await h.client.post("/detokenize", json={"model": MODEL, "tokens": sent})
        bad = await h.client.post("/detokenize", json={"model": MODEL, "tokens": [10**6]})
        unknown = await h.client.post("/tokenize", json={"model": "other", "prompt": "x"})
        both = await h.client.post(
            "/tokenize", json={"model": MODEL, "prompt": "x", "messages": MESSAGES}
        )
    body = text.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert chat.json()["tokens"] == sent, "the ids a chat request with these messages prefills"
    assert strs.json()["token_strs"] and "".join(strs.json()["token_strs"]).endswith("hi")
    assert "hello" in back.json()["prompt"]
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (404, "model")
    assert (both.status_code, both.json()["error"]["param"]) == (400, "prompt")


async def test_the_tokenizer_routes_need_the_api_key_when_keys_are_set(model_dir: Any) -> None:
    key = "sk-tokenize-0123456789"
    cfg = RouterConfig(
        model_path=model_dir, served_model_name=MODEL, security=SecuritySettings(api_keys=[key])
    )
    async with router_harness(cfg, workers()) as h:
        body = {"model": MODEL, "prompt": "x"}
        h.client.headers.pop("Authorization", None)
        refused = await h.client.post("/tokenize", json=body)
        served = await h.client.post(
            "/tokenize", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert refused.status_code == 401 and served.status_code == 200


def test_chat_template_options_reach_the_template() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{{ greeting | default('') }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    pre = Preprocessor(tok, served_model_name="m", max_model_len=512)

    def render(**fields: Any) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})
        return pre.render_chat(req)[0]

    assert render() == "[user]hello[assistant]"
    assert render(chat_template_kwargs={"greeting": "Hi! "}) == "Hi! [user]hello[assistant]"
    assert render(add_generation_prompt=False) == "[user]hello"
    partial = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    text = render(messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("[assistant]Once upon")
    for fields, param in (
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            render(**fields)
        assert err.value.param == param
