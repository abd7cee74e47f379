"""The router's peer prefix pull plan (:class:`pdserve.router.peer_pull.PeerPull`): which worker
lends a prompt's prefix to the worker that prefills it, over a KV index stand-in that answers
each worker's leading media."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pdserve.protocol import Role, WorkerRecord
from pdserve.router.kv_index import PromptHashes
from pdserve.router.peer_pull import PeerPull
from pdserve.router.view import Candidates, WorkerState
from tests.support.fakes import layout, record

PROMPT = PromptHashes([(5 * i) % 97 + 3 for i in range(20 * 16 + 1)])  # 20 full blocks


class Index:
    """Answers ``overlap_media`` from a fixed list per worker id."""

    def __init__(self, media: dict[str, list[str]]) -> None:
        self.media = media

    def overlap_media(self, worker_id: str, epoch: int, hashes: Sequence[int]) -> list[str]:
        return self.media.get(worker_id, [])[: len(hashes)]


def worker(worker_id: str, role: Role, backend: str = "tcp", **kw: Any) -> WorkerRecord:
    rec = record(worker_id, role, **kw)
    communicator = {"backend": backend, "endpoint": f"{worker_id}:8200"}
    return rec.model_copy(update={"communicator": communicator})


def plan(media: dict[str, list[str]], *others: WorkerRecord, min_tokens: int = 64) -> Any:
    puller = worker("c0", Role.COLOCATED)
    cands = Candidates(
        model="m",
        prefill=tuple(WorkerState(w, 0) for w in others if w.role is Role.PREFILL),
        decode=tuple(WorkerState(w, 0) for w in others if w.role is Role.DECODE),
        colocated=tuple(WorkerState(w, 0) for w in (puller, *others) if w.role is Role.COLOCATED),
    )
    pull = PeerPull(Index(media), client=None, min_tokens=min_tokens)  # type: ignore[arg-type]
    return pull.plan(cands, puller, PROMPT)


def test_the_worker_holding_the_most_pool_blocks_lends_them() -> None:
    got = plan(
        {"c0": ["device"] * 2, "c1": ["device"] * 12, "p0": ["device"] * 15},
        worker("c1", Role.COLOCATED),
        worker("p0", Role.PREFILL),
    )
    assert got.lender.worker_id == "p0" and (got.blocks, got.have) == (15, 2)
    assert list(got.hashes) == PROMPT.for_layout(layout())[:15]


def test_only_the_lenders_pool_counts_and_the_pullers_tiers_do() -> None:
    media = {"c0": ["host"] * 8, "c1": ["device"] * 10 + ["disk"] * 10}
    got = plan(media, worker("c1", Role.COLOCATED), min_tokens=32)  # 2 blocks more: 32 tokens
    assert got is not None and (got.blocks, got.have) == (10, 8)
    assert plan(media, worker("c1", Role.COLOCATED), min_tokens=33) is None
    media["c1"] = ["host"] * 20  # a tier block is not lent
    assert plan(media, worker("c1", Role.COLOCATED), min_tokens=1) is None


@pytest.mark.parametrize(
    "lender",
    [
        worker("c1", Role.COLOCATED, backend="nixl"),  # another transfer backend
        worker("c1", Role.COLOCATED, kv_layout=layout(tokens_per_block=8)),  # other hashes
        worker("c1", Role.COLOCATED, kv_layout=layout(dtype="bfloat16")),  # other hashes
    ],
    ids=["backend", "block-size", "dtype"],
)
def test_a_worker_whose_blocks_the_puller_cannot_take_is_no_lender(lender: WorkerRecord) -> None:
    assert plan({"c1": ["device"] * 20}, lender, min_tokens=1) is None


def test_below_the_threshold_or_turned_off_nothing_is_lent() -> None:
    media = {"c0": ["device"] * 4, "c1": ["device"] * 7}  # 3 blocks more: 48 tokens
    assert plan(media, worker("c1", Role.COLOCATED), min_tokens=64) is None
    assert plan(media, worker("c1", Role.COLOCATED), min_tokens=48).blocks == 7
    assert plan(media, worker("c1", Role.COLOCATED), min_tokens=0) is None
