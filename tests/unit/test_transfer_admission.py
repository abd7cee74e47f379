"""Admission of served transfer connections (:mod:`pdserve.transfer.connection.admission`): unproven
connections are capped apart from proven ones and evict the oldest; proven ones never lose
their slots to unproven ones."""

from __future__ import annotations

from pdserve.transfer.connection.admission import ConnectionSlots, SlotLimits

LIMITS = SlotLimits(unproven_per_host=2, unproven=3, proven_per_host=2, proven=3)


def test_a_new_unproven_connection_past_its_hosts_cap_evicts_that_hosts_oldest():
    slots: ConnectionSlots[str] = ConnectionSlots(LIMITS)
    assert slots.admit("a1", "A") == [] and slots.admit("a2", "A") == []
    assert slots.admit("a3", "A") == ["a1"]
    assert slots.unproven == 2 and slots.evicted == 1
    assert not slots.promote("a1"), "an evicted connection cannot be promoted"


def test_past_the_total_cap_the_oldest_unproven_of_any_host_is_evicted():
    slots: ConnectionSlots[str] = ConnectionSlots(LIMITS)
    slots.admit("a1", "A")
    slots.admit("b1", "B")
    slots.admit("c1", "C")
    assert slots.admit("d1", "D") == ["a1"]
    assert slots.unproven == 3


def test_proven_connections_keep_their_slots_whatever_the_unproven_flood():
    slots: ConnectionSlots[str] = ConnectionSlots(LIMITS)
    slots.admit("real", "A")
    assert slots.promote("real")
    evicted = [k for i in range(100) for k in slots.admit(f"flood{i}", "A")]
    assert "real" not in evicted and slots.proven == 1 and slots.unproven == 2
    slots.admit("real2", "A")  # a real peer's next dial evicts a flood connection
    assert slots.promote("real2") and slots.proven == 2


def test_a_proof_past_the_proven_caps_is_refused_and_frees_its_slot():
    slots: ConnectionSlots[str] = ConnectionSlots(SlotLimits(3, 3, 2, 3))
    for k in ("a1", "a2", "a3"):
        slots.admit(k, "A")
    assert slots.promote("a1") and slots.promote("a2")
    assert not slots.promote("a3") and slots.refused == 1
    assert (slots.proven, slots.unproven) == (2, 0)
    slots.release("a1")
    slots.admit("a4", "A")
    assert slots.promote("a4")


def test_release_frees_either_kind_of_slot_once():
    slots: ConnectionSlots[str] = ConnectionSlots(LIMITS)
    slots.admit("u", "A")
    slots.admit("p", "A")
    slots.promote("p")
    for _ in range(2):  # idempotent
        slots.release("u")
        slots.release("p")
    assert (slots.proven, slots.unproven) == (0, 0)
    assert slots.admit("x", "A") == [] and slots.admit("y", "A") == []
