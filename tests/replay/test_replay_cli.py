"""The ``kvtier`` command line: replay, inspect, bench; bad arguments exit 2 with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.backends import open_backend
from kvtier.keys import Namespace

from ._traces import TraceWriter, full

FAST = ["--step-ms", "1", "--block-bytes", "4KiB", "--no-progress"]


@pytest.fixture
def small_trace(write_trace: TraceWriter) -> Path:
    return write_trace([full([0, 1, 2]), full([0, 1, 2, 3]), full([0, 1, 4]), full([5])])


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        cli.main(args)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_replay_a_trace_file(small_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # whole cells: the validation note on one line
    out_json = tmp_path / "r.json"
    out_png = tmp_path / "r.png"
    code, out, err = _run(["replay", str(small_trace), "--tier", (tmp_path / "t").as_uri(),
                           "--json", str(out_json), "--plot", str(out_png), *FAST], capsys)
    assert code == 0, err
    assert "│ ideal " in out and "file" in out
    assert "ideal = an infinite cache" in " ".join(out.split())  # the terms, below the tables
    assert "n/a: no published numbers for this trace" in out
    data = json.loads(out_json.read_text())
    result = data["results"][0]
    assert result["requests"] == 4 and result["block_refs"] == 11
    assert result["block_hits"] == result["ideal_block_hits"] == 3 + 2
    assert data["settings"]["block_bytes"] == 4096
    assert data["settings"]["prefetch"] == "off"  # the replay's default
    assert set(result["prefetch"]) >= {"prefetched_blocks", "used_blocks", "wasted_blocks",
                                       "cancelled_blocks"}
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_prefetch_on_and_off(small_trace: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    for mode in ("on", "off"):
        out_json = tmp_path / f"{mode}.json"
        code, out, err = _run(["replay", str(small_trace), "--tier",
                               (tmp_path / mode).as_uri(), "--prefetch", mode, "--json",
                               str(out_json), *FAST], capsys)
        assert code == 0, err
        data = json.loads(out_json.read_text())
        assert data["settings"]["prefetch"] == mode
        assert "prefetch (blocks)" in out
    assert "none (off" in out
    assert set(data["results"][0]["prefetch"].values()) == {0}


def test_default_replay_uses_the_bundled_trace_and_validates(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli.replay, "DEFAULT_TRACE_REQUESTS", 40)
    monkeypatch.setenv("COLUMNS", "200")  # whole cells: the validation note on one line
    code, out, err = _run(["replay", "--scratch-dir", str(tmp_path), *FAST], capsys)
    assert code == 0, err
    assert "builtin:conversation" in out
    assert "40 requests" in out
    assert "PASSED: Mooncake FAST'25 conversation_trace.jsonl" in " ".join(out.split())


def test_compare_shows_three_strategies(small_trace: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["replay", str(small_trace), "--compare", "--scratch-dir",
                           str(tmp_path), *FAST], capsys)
    assert code == 0, err
    assert "lookup strategies on the same trace" in out
    for strategy in ("kvtier", "per-request", "no-reuse"):
        assert f"strategy {strategy}" in out


def test_bad_trace_line_exits_2_naming_line_and_field(
        write_trace: TraceWriter, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace([full([0]), '{"timestamp": 1, "input_length": "x", "output_length": 1, '
                                   '"hash_ids": [0]}', full([0, 1])])
    code, _, err = _run(["replay", str(path), *FAST], capsys)
    assert code == 2
    assert f"bad trace: {path}, line 2: field 'input_length'" in err
    assert "--skip-bad-lines" in err
    code, out, err = _run(["replay", str(path), "--skip-bad-lines", "--scratch-dir",
                           str(tmp_path), *FAST], capsys)
    assert code == 0, err
    assert "bad lines skipped" in out and "│ 1 │" in out.replace(" ", "").replace("│1│", "│ 1 │")


def test_missing_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["replay", str(tmp_path / "nope.jsonl"), *FAST], capsys)
    assert code == 2 and "nope.jsonl: no such file" in err


@pytest.mark.parametrize(("args", "message"), [
    (["replay", "--instances", "0"], "argument --instances: expected an integer >= 1, got '0'"),
    (["replay", "--block-bytes", "1000"],
     "argument --block-bytes: expected a size >= 16 bytes and a multiple of 16, got '1000'"),
    (["replay", "--block-bytes", "lots"], "expected a byte count or a binary size such as '64KiB'"),
    (["replay", "--tier", "ftp://host/x"], "argument --tier: expected a tier URL with a scheme"),
    (["replay", "--speed", "-1"],
     "argument --speed: expected a finite number >= 0.001 and <= 1000000.0, got '-1'"),
    (["replay", "--step-ms", "nan"], "argument --step-ms: expected a finite number >= 0"),
    (["replay", "--route", "random"], "argument --route: invalid choice: 'random'"),
    (["replay", "--prefetch", "maybe"], "argument --prefetch: invalid choice: 'maybe'"),
    (["replay", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["replay", "a.jsonl", "b.jsonl"], "unrecognized arguments: b.jsonl"),
    ([], "the following arguments are required: COMMAND"),
    (["inspect"], "the following arguments are required: URL"),
    (["bench", "--requests", "x"], "argument --requests: expected an integer >= 1, got 'x'"),
])
def test_bad_arguments_exit_2_with_a_clear_message(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(args, capsys)
    assert message in err
    assert "Traceback" not in err


def test_bad_tier_url_detail_exits_2(small_trace: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    # Refused while parsing, before the run: one line, no usage dump, no cleanup warning.
    err = _usage_error(["replay", str(small_trace), "--tier", "file://relative", *FAST], capsys)
    assert err.splitlines() == [
        "kvtier replay: error: argument --tier: file backend URL 'file://relative': expected "
        "file:///absolute/path (see `kvtier replay --help`)"]


def test_missing_matplotlib_is_a_usage_error(small_trace: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Fault injection (a mock): matplotlib is installed here; its absence is simulated."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _run(["replay", str(small_trace), "--plot", "x.png", *FAST], capsys)
    assert code == 2 and "pip install 'kvtier[plot]'" in err


def test_inspect_shows_stats_and_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = (tmp_path / "store").as_uri()
    backend = open_backend(url, Namespace(model="m", revision="r"))
    try:
        assert backend.put_many([b"k" * 16], [b"x" * 64]) == [True]
    finally:
        backend.close()
    code, out, err = _run(["inspect", url, "--namespace", "model=m", "--namespace",
                           "revision=r", "--key", (b"k" * 16).hex(), "--key", "00ff"], capsys)
    assert code == 0, err
    assert f"key {(b'k' * 16).hex()}: present" in out
    assert "key 00ff: absent" in out
    assert "bytes_written" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--key", "zz"], "--key: expected hexadecimal bytes, got 'zz'"),
    (["--namespace", "colour=red"], "--namespace: unknown namespace field(s) ['colour']"),
    (["--namespace", "model"], "expected FIELD=VALUE, got 'model'"),
])
def test_inspect_bad_input(tmp_path: Path, args: list[str], message: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    url = (tmp_path / "store").as_uri()
    try:
        code, _, err = _run(["inspect", url, *args], capsys)
    except SystemExit as exc:
        code, err = int(str(exc.code)), capsys.readouterr().err
    assert code == 2 and message in err


def test_inspect_bad_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["inspect", "file://relative/x"], capsys)
    assert code == 2 and "URL 'file://relative/x'" in err


def test_bench_prints_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["bench", "--requests", "30", "--block-bytes", "4KiB"], capsys)
    assert code == 0, err
    assert "backend calls: kvtier" in out and "fewer" in out


def test_console_script_entry_point(small_trace: Path, tmp_path: Path) -> None:
    """The installed ``kvtier`` script runs in a fresh process and exits 2 on bad input."""
    script = Path(sys.executable).with_name("kvtier")
    env = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    done = subprocess.run([str(script), "replay", "--instances", "-3"], capture_output=True,
                          text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2
    assert "expected an integer >= 1, got '-3'" in done.stderr
    done = subprocess.run([str(script), "replay", str(small_trace), "--scratch-dir",
                           str(tmp_path), *FAST], capture_output=True, text=True, timeout=60,
                          check=False, env=env)
    assert done.returncode == 0, done.stderr
    assert "│ ideal " in done.stdout
    assert "ideal = an infinite cache" in " ".join(done.stdout.split())




def test_replay_a_directory_of_sessions(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    for name in ("a", "b"):
        turns = [{"t": 2.0 * t, "in": 64 * (2 + t) + 7, "out": 64, "hash_ids": list(range(2 + t))}
                 for t in range(3)]
        (sessions / f"{name}.json").write_text(json.dumps(
            {"block_size": 64, "hash_id_scope": "local", "requests": turns}))
    out_json = tmp_path / "r.json"
    code, out, err = _run(["replay", str(sessions), "--tier", (tmp_path / "t").as_uri(),
                           "--json", str(out_json), "--seed", "3", *FAST], capsys)
    assert code == 0, err
    assert "session causality" in out and "floor" in out
    result = json.loads(out_json.read_text())["results"][0]
    assert (result["requests"], result["sessions"], result["requests_rejected"]) == (6, 2, 0)
    assert result["block_hits"] == result["ideal_block_hits"] == 2 * (2 + 3)
    assert result["hash_convention"] == "floor"


def test_hash_convention_flag(write_trace: TraceWriter, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    floor_trace = write_trace([{"timestamp": 0, "input_length": 1100, "output_length": 1,
                                "hash_ids": [1, 2]}])
    code, _, err = _run(["replay", str(floor_trace), "--hash-convention", "ceil", *FAST], capsys)
    assert code == 2
    assert "the line follows the other convention; try --hash-convention auto" in err
    code, out, err = _run(["replay", str(floor_trace), "--tier", (tmp_path / "t").as_uri(),
                           "--hash-convention", "floor", *FAST], capsys)
    assert code == 0, err
    assert "arrival order" in out


def test_the_plot_of_a_short_replay_reads_right(write_trace: TraceWriter) -> None:
    """Issue 20: "one window of 1 requests", and the legend over the lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.cli.replay import replay_all, replay_options
    from kvtier.replay.reader import read_trace
    from kvtier.replay.report import plot_figure
    from kvtier.replay.results import ReplayReport
    from kvtier.replay.strategies import Strategy

    trace = read_trace(str(write_trace([full([0, 1]), full([0, 1, 2])])))
    args = cli._build_parser().parse_args(["replay", *FAST])
    options = replay_options(args)
    results = replay_all(trace, options, [Strategy.KVTIER], False, None)
    report = ReplayReport(trace_source="t", trace_sha256="0" * 64, results=results,
                          validation=None, validation_note="n/a", settings={})
    figure = plot_figure(report, plt)
    try:
        axis = figure.axes[0]
        label = axis.get_xlabel()
        assert "1 requests" not in label and "1 windows" not in label, label
        figure.canvas.draw()
        legend = axis.get_legend().get_window_extent()
        assert not legend.overlaps(axis.get_window_extent())  # beside the lines, never on them
    finally:
        plt.close(figure)
