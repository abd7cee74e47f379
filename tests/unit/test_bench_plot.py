"""``pdserve bench serve --plot``: the picture holds the runs' samples and throughputs, is a PNG,
and a missing matplotlib is a clear error before any request is sent."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from pdserve.bench import bench_plot as bp
from pdserve.bench.serving import bench_serve as bs
from pdserve.cli import build_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _runs() -> list[bp.RunSamples]:
    """Two systems, two levels each; seconds and tokens/s chosen by hand."""
    return [
        bp.RunSamples("vllm", (
            bp.LevelSamples(1, (0.30, 0.25, 0.28), (0.021, 0.020, 0.022), 40.0),
            bp.LevelSamples(8, (2.1, 1.9), (0.034, 0.036, 0.035, 0.030), 120.0),
        )),
        bp.RunSamples("pdserve", (
            bp.LevelSamples(1, (0.29, 0.31), (0.024, 0.025), 35.0),
            bp.LevelSamples(8, (0.55, 0.60, 0.50), (0.042, 0.041), 140.0),
        )),
    ]  # fmt: skip


def _lines(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
        for line in ax.get_lines()
    }  # fmt: skip


def test_the_figure_draws_each_run_and_level() -> None:
    runs = _runs()
    fig = bp.build_figure(runs, title="SmolLM2, 256 in / 64 out")
    ttft, itl, tput = fig.axes
    for ax, metric in ((ttft, "ttft_s"), (itl, "itl_s")):
        lines = _lines(ax)
        assert set(lines) == {"vllm, c=1", "vllm, c=8", "pdserve, c=1", "pdserve, c=8"}
        for run in runs:
            for lv in run.levels:
                xs, ys = lines[f"{run.label}, c={lv.concurrency}"]
                values = getattr(lv, metric)
                assert xs == pytest.approx(sorted(v * 1e3 for v in values))
                assert ys == pytest.approx([(i + 1) / len(values) for i in range(len(values))])
        assert "ms" in ax.get_xlabel() and ax.get_xscale() == "log"
    assert _lines(tput) == {
        "vllm": ([1.0, 8.0], [40.0, 120.0]),
        "pdserve": ([1.0, 8.0], [35.0, 140.0]),
    }
    assert tput.get_ylabel() == "output tokens/s" and "concurrency" in tput.get_xlabel()
    assert [t.get_text() for t in tput.get_legend().get_texts()] == ["vllm", "pdserve"]
    assert fig.get_suptitle() == "SmolLM2, 256 in / 64 out"


def test_several_runs_share_a_colour_per_run_and_a_line_style_per_level() -> None:
    ttft = bp.build_figure(_runs()).axes[0]
    by_label = {line.get_label(): line for line in ttft.get_lines()}
    assert by_label["vllm, c=1"].get_color() == by_label["vllm, c=8"].get_color()
    assert by_label["vllm, c=1"].get_color() != by_label["pdserve, c=1"].get_color()
    assert by_label["vllm, c=1"].get_linestyle() != by_label["vllm, c=8"].get_linestyle()


def test_a_single_concurrency_is_one_point_and_empty_levels_are_left_out() -> None:
    runs = [
        bp.RunSamples("only", (bp.LevelSamples(4, (0.5,), (0.01, 0.02), 12.5),)),
        bp.RunSamples("all failed", (bp.LevelSamples(4, (), (), None),)),
    ]
    ttft, itl, tput = bp.build_figure(runs).axes
    assert _lines(ttft) == {"only, c=4": ([500.0], [1.0])}
    assert _lines(itl) == {"only, c=4": ([10.0, 20.0], [0.5, 1.0])}
    assert _lines(tput) == {"only": ([4.0], [12.5])}


def test_write_plot_writes_a_png_of_the_figure(tmp_path: Path) -> None:
    path = bp.write_plot(_runs(), tmp_path / "sub" / "serve.png", title="t")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) < 150_000
    height, width, channels = matplotlib.image.imread(path).shape
    assert (width, height) == (round(15 * bp.DPI), round(4.6 * bp.DPI)) and channels in (3, 4)


def test_samples_go_to_json_and_back() -> None:
    results = [
        bs.RequestResult(ok=True, ttft_s=0.1234567, itl_s=[0.02, 0.03], e2e_s=0.2, output_tokens=3),
        bs.RequestResult(ok=False, error="HTTP 503", e2e_s=0.01),
        bs.RequestResult(ok=True, ttft_s=0.2, itl_s=[0.04], e2e_s=0.3, output_tokens=2),
    ]
    samples = bp.level_samples_json(results, 2)
    assert samples == {"concurrency": 2, "ttft_s": [0.123457, 0.2], "itl_s": [0.02, 0.03, 0.04]}
    report = json.loads(json.dumps({"runs": [{
        "label": None, "model": "m",
        "levels": [bs.summarize(results, 0.5, 2)],
        "samples": [samples],
    }]}))  # fmt: skip
    (run,) = bp.runs_from_report(report)
    assert run.label == "m"  # no --label: the model names the run
    (lv,) = run.levels
    assert (lv.concurrency, lv.ttft_s, lv.itl_s) == (2, (0.123457, 0.2), (0.02, 0.03, 0.04))
    assert lv.output_tokens_per_s == pytest.approx(5 / 0.5)


def test_a_report_without_samples_is_a_clear_error() -> None:
    report = {"runs": [{"label": "old", "levels": [{"concurrency": 1}]}]}
    with pytest.raises(bp.PlotError, match="old.json: run 'old' holds no samples"):
        bp.runs_from_report(report, "old.json")
    with pytest.raises(bp.PlotError, match="no runs"):
        bp.runs_from_report({"runs": []})


# --- the command line -----------------------------------------------------------------------------


def test_the_parser_takes_plot_and_plot_with(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "serve", "--url", "http://h/v1"])
    assert (args.plot, args.plot_with) == (None, [])
    args = build_parser().parse_args(
        ["bench", "serve", "--plot", "out.png", "--plot-with", "a.json", "b.json"]
    )
    assert (args.plot, args.plot_with) == ("out.png", ["a.json", "b.json"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("--plot PATH.png", "--plot-with", "ECDF", "output tokens/s", "pdserve[plot]"):
        assert fragment in text, fragment


def _serve(tmp_path: Path, *extra: str) -> int:
    """``bench serve --url`` against a port nobody listens on, prompts from a file (so no
    tokenizer is loaded): any request sent would fail."""
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer_config.json").write_text("{}")
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is 1 + 1?\nName a colour.\n")
    return main(["bench", "serve", "--url", "http://127.0.0.1:9/v1", "--tokenizer", str(tok),
                 "--model", "m", "--prompt-file", str(prompts), "--concurrency", "1", "2",
                 "--num-requests", "3", "--output-len", "4", *extra])  # fmt: skip


def test_missing_matplotlib_is_a_clear_error_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: list[dict[str, Any]] = []

    async def stream(client: Any, url: str, body: dict[str, Any], kind: str = "chat") -> Any:
        sent.append(body)
        raise AssertionError("no request may be sent")

    monkeypatch.setattr(bs, "stream_openai", stream)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert _serve(tmp_path, "--plot", str(tmp_path / "p.png")) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'pdserve[plot]'" in err
    assert sent == [] and not (tmp_path / "p.png").exists()
    with pytest.raises(bp.PlotError, match=r"pip install 'pdserve\[plot\]'"):
        bp.build_figure(_runs())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--plot-with", "a.json"], "--plot-with needs --plot"),
        (["--plot", "p.svg"], "ending in .png"),
        (["--plot", "p.png", "--plot-with", "missing.json"], "missing.json"),
    ],
)
def test_bad_plot_options_stop_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert _serve(tmp_path, *extra) == 2
    assert message in capsys.readouterr().err


def test_a_run_writes_its_picture_and_a_later_run_draws_it_beside_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def stream(client: Any, url: str, body: dict[str, Any], kind: str = "chat") -> Any:
        n = int(body["max_tokens"])  # TTFT 0.1 s, then n - 1 gaps of 0.02 s
        return bs.from_stamps(0.0, [0.1 + 0.02 * i for i in range(n)], 0.2, n, 10)

    drawn: list[list[bp.RunSamples]] = []
    write_plot = bp.write_plot

    def spy(runs: list[bp.RunSamples], path: Path, title: str | None = None) -> Path:
        drawn.append(list(runs))
        return write_plot(runs, path, title)

    monkeypatch.setattr(bs, "stream_openai", stream)
    monkeypatch.setattr(bp, "write_plot", spy)
    first, png = tmp_path / "first.json", tmp_path / "first.png"
    assert _serve(tmp_path, "--label", "peer", "--json", str(first), "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    (run,) = json.loads(first.read_text())["runs"]
    assert [s["concurrency"] for s in run["samples"]] == [1, 2]
    assert run["samples"][0]["ttft_s"] == [0.1] * 3
    assert run["samples"][0]["itl_s"] == pytest.approx([0.02] * 9)

    both = tmp_path / "both.png"
    assert _serve(tmp_path, "--label", "ours", "--plot", str(both), "--plot-with", str(first)) == 0
    assert both.read_bytes()[:8] == PNG_MAGIC
    assert [r.label for r in drawn[-1]] == ["peer", "ours"]
    assert [lv.concurrency for lv in drawn[-1][1].levels] == [1, 2]
    assert all(lv.output_tokens_per_s for r in drawn[-1] for lv in r.levels)
