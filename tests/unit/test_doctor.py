"""``pdserve doctor``: the environment checks on injected facts and the probe protocol against a
real transceiver (the command itself, run as a subprocess: tests/integration/test_doctor_probe.py)."""

from __future__ import annotations

import asyncio
import os
import socket

import pydantic
import pytest

from pdserve.bench.doctor.doctor import (
    Finding,
    Level,
    check_backends,
    check_cpus,
    check_environment,
    check_net_devices,
    check_peer,
    check_progress,
    check_same_host,
    check_transports,
    exit_code,
    format_report,
)
from pdserve.bench.doctor.doctor import main as doctor_main
from pdserve.bench.doctor.doctor_facts import BackendFacts, Facts, parse_ucx_info
from pdserve.transfer import wire
from pdserve.transfer.bandwidth_probe import chunks
from pdserve.transfer.connection import auth
from pdserve.transfer.connection.control import Connection
from tests.support.servers import wait_until
from tests.support.transfer import OTHER_KEY, TEST_KEY
from tests.support.transfer_inproc import serving_transceiver as transceiver

TRANSPORTS = {"tcp": ("eth0", "lo"), "cma": ("memory",), "posix": ("memory",), "self": ("memory",)}
BACKENDS = (
    BackendFacts("tcp", True, None, "(built in)"),
    BackendFacts("nixl", True, "1.5.1"),
    BackendFacts("ucx", True, "0.52"),
)


def facts(**overrides: object) -> Facts:
    """A healthy 8-CPU, one-NIC host; ``overrides`` replace fields."""
    base = Facts(
        cpu_count=8,
        env={},
        backends=BACKENDS,
        ucx_transports=TRANSPORTS,
        ucx_source="test",
        nics=("eth0",),
        ptrace_scope=0,
    )
    return Facts(**{**base.__dict__, **overrides})  # type: ignore[arg-type]


def levels(findings: list[Finding], check: str) -> list[Level]:
    return [f.level for f in findings if f.check == check]


# ------------------------------------------------------------------ environment checks


def test_healthy_host_has_no_warnings_or_failures() -> None:
    findings = check_environment(facts())
    assert {f.level for f in findings} == {Level.OK}
    assert exit_code(findings) == 0


def test_explicitly_chosen_backend_that_does_not_load_fails_with_install_hint() -> None:
    broken = (BACKENDS[0], BackendFacts("nixl", False, None, "ImportError: no nixl"), BACKENDS[2])
    findings = check_backends(facts(backends=broken), wanted="nixl")
    (nixl,) = [f for f in findings if f.check == "backend nixl"]
    assert nixl.level is Level.FAIL and "pip install nixl" in nixl.fix
    assert exit_code(findings) == 1


def test_missing_optional_backend_warns_and_auto_falls_back_to_tcp() -> None:
    broken = (BACKENDS[0], BackendFacts("nixl", False, None, "ImportError"), BACKENDS[2])
    findings = check_backends(facts(backends=broken), wanted="auto")
    assert levels(findings, "backend nixl") == [Level.WARN]
    (auto,) = [f for f in findings if f.check == "backend auto"]
    assert auto.level is Level.WARN and "picks tcp" in auto.message
    assert exit_code(findings) == 0


@pytest.mark.parametrize("tls", ["tcp", "tcp,self", "^shm", "^cma,sm"])
def test_ucx_tls_that_keeps_one_host_off_shared_memory_warns(tls: str) -> None:
    findings = check_same_host(facts(env={"UCX_TLS": tls}))
    (tls_finding,) = [f for f in findings if f.check == "UCX_TLS"]
    assert tls_finding.level is Level.WARN and "unset UCX_TLS" in tls_finding.fix


@pytest.mark.parametrize("tls", ["tcp,shm,self", "tcp,cma", "all", "^ib"])
def test_ucx_tls_that_keeps_shared_memory_is_ok(tls: str) -> None:
    assert levels(check_same_host(facts(env={"UCX_TLS": tls})), "UCX_TLS") == [Level.OK]


def test_yama_ptrace_restriction_warns_that_cma_is_unusable() -> None:
    findings = check_same_host(facts(ptrace_scope=1))
    (scope,) = [f for f in findings if f.check == "ptrace_scope"]
    assert scope.level is Level.WARN and "ptrace_scope=0" in scope.fix


def test_unset_net_devices_on_a_multi_nic_host_warns_naming_the_nics() -> None:
    (f,) = check_net_devices(facts(nics=("eth0", "eth1")))
    assert f.level is Level.WARN and "eth0, eth1" in f.message and "UCX_NET_DEVICES" in f.fix


def test_unset_net_devices_with_one_nic_is_ok() -> None:
    assert [f.level for f in check_net_devices(facts(nics=("eth0",)))] == [Level.OK]


def test_loopback_only_net_devices_warn_that_other_hosts_are_unreachable() -> None:
    (f,) = check_net_devices(facts(env={"UCX_NET_DEVICES": "lo"}))
    assert f.level is Level.WARN and "no other host" in f.message


def test_net_devices_naming_an_interface_that_is_not_up_warn() -> None:
    (f,) = check_net_devices(facts(env={"UCX_NET_DEVICES": "eth7"}))
    assert f.level is Level.WARN and "eth7" in f.message


def test_ucxx_thread_progress_mode_warns_and_polling_does_not() -> None:
    slow = check_progress(facts(env={"UCXPY_PROGRESS_MODE": "thread"}))
    assert levels(slow, "UCXPY_PROGRESS_MODE") == [Level.WARN]
    assert not levels(
        check_progress(facts(env={"UCXPY_PROGRESS_MODE": "polling"})), "UCXPY_PROGRESS_MODE"
    )


def test_two_cpus_warn_with_a_thread_budget() -> None:
    (f,) = check_cpus(facts(cpu_count=2))
    assert f.level is Level.WARN and "--threads 1" in f.fix


def test_unknown_transports_warn_and_missing_shared_memory_warns() -> None:
    assert [f.level for f in check_transports(facts(ucx_transports=None))] == [Level.WARN]
    (f,) = check_transports(facts(ucx_transports={"tcp": ("lo",), "self": ("memory",)}))
    assert f.level is Level.WARN and "no shared-memory transport" in f.message


def test_ucx_info_output_is_parsed_into_transports_and_devices() -> None:
    text = """#
# Memory domain: tcp
#     Component: tcp
#      Transport: tcp
#         Device: eth0
#      Transport: tcp
#         Device: lo
# Memory domain: cma
#      Transport: cma
#         Device: memory
"""
    assert parse_ucx_info(text) == {"tcp": ("eth0", "lo"), "cma": ("memory",)}


def test_report_prints_each_fix_and_the_counts() -> None:
    text = format_report(check_environment(facts(cpu_count=2)), "title")
    assert "WARN  cpus:" in text and "fix: give each worker" in text
    assert text.splitlines()[-1].endswith("1 WARN, 0 FAIL")


# ------------------------------------------------------------------ probe against a transceiver


async def test_peer_probe_reports_worker_round_trip_and_bandwidth() -> None:
    async with transceiver() as t:
        findings = await check_peer(t.endpoint, key=TEST_KEY, nbytes=2 << 20, timeout_s=20)
    assert exit_code(findings) == 0
    assert "worker prefill-doc (epoch 42), backend tcp" in findings[0].message
    (bandwidth,) = [f for f in findings if f.check == "peer bandwidth"]
    assert "GB/s p50" in bandwidth.message


async def test_peer_that_is_not_listening_fails() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    findings = await check_peer(f"127.0.0.1:{port}", key=TEST_KEY, nbytes=1 << 20, timeout_s=5)
    assert [f.level for f in findings] == [Level.FAIL]
    assert exit_code(findings) == 1


async def test_probe_bytes_are_zeros_never_the_kv_pool() -> None:
    async with transceiver(fill=1.0) as t:
        conn = await Connection.open(t.endpoint, 10.0)
        try:
            await auth.dial(conn, TEST_KEY, auth.PROBE_PEER_ID)
            await conn.send(wire.Probe(nbytes=3000))
            answer = await conn.recv()
            payload = bytearray(3000)
            await conn.recv_segments(memoryview(payload), *chunks(3000))
        finally:
            conn.close()
    assert isinstance(answer, wire.ProbeData) and answer.worker_id == "prefill-doc"
    assert payload == bytes(3000)


async def _closed_without_answer(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closed the connection without sending one byte (a reset counts)."""
    try:
        return await reader.read() == b""
    except ConnectionResetError:
        return True


async def test_probe_without_authentication_is_refused_and_gets_no_byte() -> None:
    async with transceiver() as t:
        host, port = t.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(wire.encode(wire.Probe(nbytes=3000)))  # the pre-authentication protocol
        assert await _closed_without_answer(reader)
        writer.close()
        await wait_until(lambda: t.auth_failures.total == 1, 5.0, what="the refusal counted")


async def test_probe_with_another_clusters_secret_fails_naming_the_secret() -> None:
    async with transceiver() as t:
        findings = await check_peer(t.endpoint, key=OTHER_KEY, nbytes=1 << 20, timeout_s=10)
        await wait_until(lambda: t.auth_failures.total == 1, 5.0, what="the refusal counted")
    (peer,) = findings
    assert peer.level is Level.FAIL and "could not prove" in peer.message
    assert "--cluster-secret-file" in peer.fix and exit_code(findings) == 1


def test_doctor_refuses_to_probe_without_a_cluster_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("PDSERVE_"):
            monkeypatch.delenv(name)
    assert doctor_main(["--peer", "127.0.0.1:9"]) == 2  # before any check or connection
    out = capsys.readouterr().out
    assert "refusing to probe without it" in out and "--cluster-secret-file" in out


def test_probe_larger_than_the_bound_is_refused_by_the_schema() -> None:
    with pytest.raises(pydantic.ValidationError):
        wire.Probe(nbytes=wire.PROBE_MAX_BYTES + 1)
