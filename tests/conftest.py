"""Shared fixtures and the folder markers. Shared test support (fixtures, fakes, rigs) lives in tests/support/.

Every test is marked after its folder, so a marker expression selects folders:

==============  ===========================================================================
marker          folder: what its tests need
==============  ===========================================================================
``unit``        tests/unit: in-process, CPU only, fakes; seconds each (the fast selection)
``integration`` tests/integration: real servers (etcd, NATS) or worker / peer processes
``e2e``         tests/e2e: the whole stack (router + workers) as processes
``chaos``       tests/chaos: faults (kill -9, SIGSTOP, etcd/NATS restarts) under load against
                ``pdserve up`` itself (docs/reliability.md)
``container``   tests/container: images built and run with podman (skips without it)
``deploy``      tests/deploy: Kubernetes manifests (skips without a cluster)
``gpu``         tests/gpu: CUDA (skips without a GPU)
==============  ===========================================================================

``slow`` is orthogonal to the folders: a test that loads the SmolLM2 weights (minutes of CPU).

Fast selection: ``pytest -m unit``. A plain ``pytest`` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_DTYPE = os.environ.setdefault("PDSERVE_MODEL__DTYPE", "float32")
"""The model dtype of every process the tests start (an environment variable, so processes
started as subprocesses read it; the stacks of ``tests.support.stack`` write it into their
config file, since the product's stack hands its children no ``PDSERVE_*`` setting; in-process
engines take it from ``tests.support.engine``). The tests
compare against transformers in float32 token for token, and ``--dtype auto`` narrows to
bfloat16 on CPUs with AMX or AVX-512 BF16 (CI's among them), where greedy decoding may part at a
near-tie. ``PDSERVE_MODEL__DTYPE=auto pytest`` runs the suite on the product's default."""
os.environ.setdefault("PDSERVE_MODEL__GENERATION_CONFIG", "none")
"""Likewise the sampling defaults of stacks the tests start: OpenAI's, not the model folder's
(SmolLM2's repetition_penalty 1.1 would apply to the tests' greedy requests, which compare
against transformers' plain greedy). tests/e2e/test_up_smollm2.py runs README's main job on the
product's defaults: it drops both variables."""

pytest_plugins = [
    "tests.support.models",
    "tests.support.servers",
    "tests.support.stack",
    "tests.support.kv_peer",  # after servers, which it imports (assertions rewritten there)
]

FOLDER_MARKERS = ("unit", "integration", "e2e", "chaos", "container", "deploy", "gpu")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its folder's marker (``tests/<folder>/...``)."""
    for item in items:
        try:
            folder = item.path.resolve().relative_to(_TESTS).parts[0]
        except (ValueError, IndexError):
            continue
        if folder in FOLDER_MARKERS:
            item.add_marker(folder)
