"""The compose topology with the `nats` profile and PDSERVE_DISCOVERY_URL=nats://nats:4222: the
router and workers find each other through NATS (JetStream key-value bucket) instead of etcd.

A module of its own, so the etcd stack of test_compose.py is down before this one comes up.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.podman_stack import MODEL, ComposeStack

pytestmark = pytest.mark.timeout(1800)


def test_nats_profile_serves_through_nats_discovery(container_images: dict[str, str]) -> None:
    with ComposeStack(
        container_images, profiles=("nats",), env={"PDSERVE_DISCOVERY_URL": "nats://nats:4222"}
    ) as stack:
        body = stack.wait_ready(200).json()
        assert len(body["prefill"]) == 1 and len(body["decode"]) == 1, body
        for service in ("router", "prefill", "decode"):
            assert "nats://nats:4222" in stack.logs(service, tail=400), (
                f"{service} did not use NATS:\n{stack.logs(service)}"
            )
        client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
    assert not stack.leftovers(), f"compose down left {stack.leftovers()}"
