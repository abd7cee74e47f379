"""Session fixtures for the container tests: the images, built once per test session.

``container_images`` skips (with the reason) when podman, podman-compose, the base image or the
etcd/NATS wheels are missing; otherwise it builds the pdserve image from the top-level
Dockerfile and the etcd/NATS stand-ins, and returns their tags.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.podman_stack import (
    PDSERVE_IMAGE,
    build_pdserve_image,
    build_standin_images,
    missing_tools,
)

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def container_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``{"pdserve": tag, "etcd": tag, "nats": tag}``, built with podman (``--layers``: a rerun
    with unchanged sources takes seconds). Build logs land in a session temp folder."""
    reason = missing_tools()
    if reason is not None:
        pytest.skip(reason)
    logs: Path = tmp_path_factory.mktemp("container-builds")
    built = build_pdserve_image(logs, PDSERVE_IMAGE)
    log.warning(
        "built %s in %.0f s (%.2f GB); logs in %s",
        built.tag,
        built.seconds,
        built.size_bytes / 1e9,
        logs,
    )
    yield {"pdserve": built.tag, **build_standin_images(logs)}
