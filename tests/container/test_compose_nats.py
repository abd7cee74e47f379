"""The compose topology with the `nats` profile and PDSERVE_DISCOVERY_URL=nats://nats:4222: the
router and workers find each other through NATS (JetStream key-value bucket) instead of etcd.

A module of its own, so the etcd stack of test_compose.py is down before this one comes up. Its
workers run eagerly (``model.compile: false`` in a copy of the mounted config, through
PDSERVE_CONFIG_FILE): test_compose.py checks the compiled forward in the image, and compiling
it again here cost about 40 s of this test's 110 s on 2 cores (109 -> 73 s).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from tests.support.podman_stack import MODEL, QUESTION, ComposeStack

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "1p1d-etcd.yaml"

pytestmark = pytest.mark.timeout(1800)


def test_nats_profile_serves_through_nats_discovery(
    container_images: dict[str, str], tmp_path: Path
) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    config["model"]["compile"] = False
    eager = tmp_path / "1p1d-nats-eager.yaml"
    eager.write_text(yaml.safe_dump(config))
    eager.chmod(0o644)  # read by the containers' non-root user
    env = {"PDSERVE_DISCOVERY_URL": "nats://nats:4222", "PDSERVE_CONFIG_FILE": str(eager)}
    with ComposeStack(container_images, profiles=("nats",), env=env) as stack:
        body = stack.wait_ready(200).json()
        assert len(body["prefill"]) == 1 and len(body["decode"]) == 1, body
        for service in ("router", "prefill", "decode"):
            assert "nats://nats:4222" in stack.logs(service, tail=400), (
                f"{service} did not use NATS:\n{stack.logs(service)}"
            )
        for role in ("prefill", "decode"):  # the mounted copy of the config was read
            assert "compiled the model forward in" not in stack.logs(role, tail=2000), role
        client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        reply = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=32,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
    assert not stack.leftovers(), f"compose down left {stack.leftovers()}"
