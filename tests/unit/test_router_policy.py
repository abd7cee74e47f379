"""Pairing policy and worker view: least loaded compatible pair, clear 503s, readiness."""

from __future__ import annotations

import pytest

from pdserve.errors import NoWorkerError
from pdserve.protocol import PROTOCOL_VERSION, WorkerLoad
from pdserve.router.policy import choose_pair
from pdserve.router.view import WorkerView
from tests.support.fakes import MODEL, FakeWatcher, layout, record


def view_of(*records) -> WorkerView:
    return WorkerView(FakeWatcher(list(records)), served_model_name=MODEL)


def test_picks_least_loaded_prefill_and_decode_by_reported_load():
    view = view_of(
        record("p0", "prefill", load=WorkerLoad(running=3, waiting=2)),
        record("p1", "prefill", load=WorkerLoad(running=1)),
        record("d0", "decode", load=WorkerLoad(running=1, free_blocks=10)),
        record("d1", "decode", load=WorkerLoad(running=1, free_blocks=50)),
        record("d2", "decode", load=WorkerLoad(running=4, waiting=1, free_blocks=99)),
    )
    pair = choose_pair(view.candidates())
    assert (pair.prefill.worker_id, pair.decode.worker_id) == ("p1", "d1")


def test_router_in_flight_count_outweighs_reported_load():
    view = view_of(
        record("p0", "prefill", load=WorkerLoad(running=5)),
        record("p1", "prefill", load=WorkerLoad(running=0)),
        record("d0", "decode"),
    )
    with view.track("p1"):
        assert choose_pair(view.candidates()).prefill.worker_id == "p0"
    assert view.in_flight("p1") == 0
    assert choose_pair(view.candidates()).prefill.worker_id == "p1"


def test_pairs_only_workers_whose_kv_layouts_the_formatter_maps():
    view = view_of(
        record("p0", "prefill", kv_layout=layout(num_kv_heads=4)),
        record("p1", "prefill", load=WorkerLoad(running=9)),
        record("d0", "decode"),
    )
    pair = choose_pair(view.candidates())
    assert (pair.prefill.worker_id, pair.decode.worker_id) == ("p1", "d0")


def test_block_size_and_kv_dtype_differences_still_pair():
    view = view_of(
        record("p0", "prefill", kv_layout=layout(tokens_per_block=32, dtype="bfloat16")),
        record("d0", "decode"),
    )
    pair = choose_pair(view.candidates())
    assert (pair.prefill.worker_id, pair.decode.worker_id) == ("p0", "d0")
    assert view.readiness().ready


def test_no_compatible_pair_is_a_503_naming_the_layouts():
    view = view_of(
        record("p0", "prefill", kv_layout=layout(num_kv_heads=4)),
        record("d0", "decode"),
    )
    with pytest.raises(NoWorkerError, match="mappable KV layouts") as err:
        choose_pair(view.candidates())
    assert err.value.status == 503
    assert layout(num_kv_heads=4).compat_hash() in err.value.message
    assert "num_kv_heads: 4 != 2" in err.value.message


@pytest.mark.parametrize(
    ("records", "missing"),
    [
        ([record("d0", "decode")], "no live prefill worker"),
        ([record("p0", "prefill")], "no live decode worker"),
        ([], "no live prefill worker"),
    ],
)
def test_missing_role_is_a_503_saying_which(records, missing):
    with pytest.raises(NoWorkerError, match=missing):
        choose_pair(view_of(*records).candidates())


def test_excluded_prefill_worker_is_not_chosen():
    view = view_of(record("p0", "prefill"), record("p1", "prefill"), record("d0", "decode"))
    assert choose_pair(view.candidates(), exclude_prefill={"p0"}).prefill.worker_id == "p1"
    with pytest.raises(NoWorkerError, match="other than p0, p1"):
        choose_pair(view.candidates(), exclude_prefill={"p0", "p1"})


def test_view_ignores_other_models_and_other_protocols_and_lists_colocated_workers():
    view = view_of(
        record("p-other", "prefill", model="another-model"),
        record("c0", "colocated"),
        record("p-old", "prefill", protocol_version=PROTOCOL_VERSION + 1),
        record("d0", "decode"),
    )
    cands = view.candidates()
    assert cands.prefill == ()
    assert [w.worker_id for w in cands.decode] == ["d0"]
    assert [w.worker_id for w in cands.colocated] == ["c0"]
    with pytest.raises(NoWorkerError, match="p-old speaks protocol"):
        choose_pair(cands)


def test_readiness_needs_a_decode_or_colocated_worker_and_reports_the_paths():
    watcher = FakeWatcher([record("p0", "prefill")])
    view = WorkerView(watcher, served_model_name=MODEL)
    r = view.readiness()
    assert not r.ready and r.prefill == ("p0",) and r.paths == ()
    assert r.missing == (f"decode or colocated worker for model {MODEL!r}",)

    # A decode worker P's layout does not map to still serves: it prefills locally.
    watcher.put(record("d0", "decode", kv_layout=layout(num_kv_heads=4)))
    r = view.readiness()
    assert r.ready and r.paths == ("local_prefill",)
    assert "no prefill/decode pair with mappable KV layouts" in r.notes[0]

    watcher.put(record("d1", "decode"))
    r = view.readiness()
    assert r.ready and r.decode == ("d0", "d1") and r.missing == () and r.notes == ()
    assert r.paths == ("disaggregated", "local_prefill")

    watcher.remove("p0")
    watcher.put(record("c0", "colocated"))
    r = view.readiness()
    assert r.ready and r.paths == ("local_prefill", "colocated") and r.colocated == ("c0",)

    colocated_only = view_of(record("c0", "colocated"))
    assert colocated_only.readiness().ready
    assert colocated_only.readiness().paths == ("colocated",)


def test_unreachable_worker_is_left_out_until_it_restarts_or_the_cooldown_ends():
    dead = record("p0", "prefill")
    watcher = FakeWatcher([dead, record("d0", "decode")])
    view = WorkerView(watcher, served_model_name=MODEL, suspect_s=60)
    view.mark_unreachable(dead)
    with pytest.raises(NoWorkerError, match="p0 was unreachable"):
        choose_pair(view.candidates())

    watcher.put(dead.model_copy(update={"epoch": dead.epoch + 1}))  # restarted
    assert choose_pair(view.candidates()).prefill.worker_id == "p0"

    quick = WorkerView(watcher, served_model_name=MODEL, suspect_s=0)
    quick.mark_unreachable(watcher.workers()["p0"])
    assert choose_pair(quick.candidates()).prefill.worker_id == "p0"
