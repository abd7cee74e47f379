"""Router and workers find each other through a real etcd server (started by a fixture)."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.support.stack import start_stack


def test_requests_flow_with_etcd_discovery(
    tiny_model_dir: Path, tmp_path: Path, etcd_server
) -> None:
    stack = start_stack(tiny_model_dir, "tiny-llama", tmp_path, discovery=etcd_server.url)
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        resp = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert resp.usage.completion_tokens >= 1
        streamed = client.completions.create(
            model="tiny-llama", prompt=[1, 2, 3, 4], max_tokens=5, stream=True, temperature=0
        )
        assert sum(1 for c in streamed if c.choices and c.choices[0].text) >= 1
    finally:
        stack.stop()
