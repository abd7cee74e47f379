"""``pdserve bench router`` measures both paths against its scripted worker and prints rows."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serving.bench_router import add_arguments, main


@pytest.mark.parametrize("client", ["wire", "httpx"])
def test_rows_for_each_concurrency(capsys: pytest.CaptureFixture[str], client: str) -> None:
    """Both HTTP clients, as the load and as the router's worker client."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--requests", "6", "--concurrency", "1", "3", "--tokens", "2",
                              "--client", client, "--worker-client", client])  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for _, direct, routed, added, rate, cpu_us in rows:
        assert float(direct) > 0 and float(routed) > 0 and float(rate) > 0
        assert abs(float(routed) - float(direct) - float(added)) < 0.02
        float(cpu_us)  # the router's CPU per request, from /proc (ticks: may round to 0)
    assert "--http httptools --loop uvloop" in out[0]  # the router as pdserve router runs it
    assert f"--worker-client {client}, load from --client {client}" in out[0]
