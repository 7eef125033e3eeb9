"""The rough edges a new user hit (issue 20), one test each, with real parts: real directories,
FIFOs, a real pseudo-terminal for the purge prompt, a real subprocess whose ``vllm`` cannot be
imported. Each test fails on the code before the fix."""

from __future__ import annotations

import json
import os
import pty
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.cli.common import purge_commands

FAST = ["--step-ms", "0", "--block-bytes", "4KiB", "--no-progress"]
_SRC = Path(__file__).resolve().parents[2] / "src"


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _parse_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        cli.main(args)
    assert caught.value.code == 2
    return capsys.readouterr().err


def _trace(path: Path, count: int = 6) -> Path:
    lines = [{"timestamp": index, "input_length": 1024, "output_length": 8,
              "hash_ids": [0, index + 1]} for index in range(count)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


# ---- read-only means read-only ---------------------------------------------------------------

@pytest.mark.parametrize("command", [["inspect"], ["usage"], ["inspect", "--digest", "abcdef"],
                                     ["purge", "--digest", "abcdef", "--yes"]])
def test_a_missing_file_tier_is_named_created_never_and_exits_1(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: inspect created <root>/<digest>/ and exited 0; usage exited 2."""
    typo = tmp_path / "typo"
    code, _, err = _run([command[0], typo.as_uri(), *command[1:]], capsys)
    assert code == 1, err
    assert f"no kvtier tier at {typo.as_uri()}" in err and "does not exist" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not typo.exists()


def test_inspect_of_an_existing_tier_creates_no_namespace_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["inspect", tmp_path.as_uri(), "--namespace", "model=nothing-here"],
                          capsys)
    assert code == 0, err
    assert _tree(tmp_path) == []
    code, out, _ = _run(["usage", tmp_path.as_uri()], capsys)
    assert code == 0 and "no manifest" not in out and "0 namespace(s)" in out


def test_usage_of_a_bare_path_suggests_the_file_url(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["usage", str(tmp_path)], capsys)
    assert code == 2
    assert f"did you mean {tmp_path.as_uri()}?" in err
    err = _parse_error(["replay", "--tier", str(tmp_path), *FAST], capsys)
    assert f"did you mean {tmp_path.as_uri()}?" in err


# ---- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("problem", ["missing directory", "fifo", "directory"])
def test_a_bad_json_path_fails_before_the_replay(
        problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the whole replay ran, then writing the report failed."""
    target = {"missing directory": tmp_path / "no" / "r.json", "fifo": tmp_path / "fifo",
              "directory": tmp_path}[problem]
    if problem == "fifo":
        os.mkfifo(target)
    trace = _trace(tmp_path / "t.jsonl")
    code, out, err = _run(["replay", str(trace), "--json", str(target), *FAST], capsys)
    assert code == 2
    assert out == ""  # no report: nothing was replayed
    assert err.startswith(f"kvtier replay: error: --json {target}: ")
    assert len(err.strip().splitlines()) == 1
    assert {"missing directory": "does not exist", "fifo": "is a FIFO",
            "directory": "is a directory"}[problem] in err


def test_keep_prints_the_purge_command_to_paste(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `kvtier purge URL --namespace revision=REV`, placeholders to fill in."""
    tier = tmp_path / "tier"
    trace = _trace(tmp_path / "t.jsonl")
    code, out, err = _run(["replay", str(trace), "--tier", tier.as_uri(), "--keep", *FAST],
                          capsys)
    assert code == 0, err
    commands = [line.strip() for line in out.splitlines()
                if line.strip().startswith("kvtier purge ")]
    assert len(commands) == 1 and "URL" not in commands[0] and "REV" not in commands[0]
    words = shlex.split(commands[0])
    code, removed, err = _run([*words[1:], "--yes"], capsys)
    assert code == 0 and "removed" in removed, err
    code, listed, _ = _run(["usage", tier.as_uri()], capsys)
    assert "0 namespace(s)" in listed


def test_the_purge_command_of_a_url_with_a_secret_reads_it_from_the_environment() -> None:
    lines = purge_commands("redis://user:Pa55word@host:6379/0?ttl_s=60", ["t1-kvtier"])
    assert lines[0] == ('kvtier purge "$TIER_URL" --namespace model=kvtier-replay '
                        "--namespace revision=t1-kvtier")
    assert "export TIER_URL='redis://user:***@host:6379/0?ttl_s=60'" in lines[1]
    assert "Pa55word" not in "\n".join(lines)


def test_a_bad_tier_url_is_one_line_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 12 lines of usage, then (after the run failed) a warning that the replay's blocks
    could not be removed."""
    trace = _trace(tmp_path / "t.jsonl")
    err = _parse_error(["replay", str(trace), "--tier", "file:///tmp/x?bogus=1", *FAST], capsys)
    assert err.splitlines() == [
        "kvtier replay: error: argument --tier: unknown file backend setting(s) ['file.bogus']; "
        "expected some of ['auth_key', 'auth_key_file', 'fsync', 'max_bytes', 'native_io', "
        "'o_direct', 'shared_dir'] (see `kvtier replay --help`)"]
    assert "could not remove" not in err and "usage:" not in err


@pytest.mark.parametrize("words", [["--block-bytes", "-16KiB"], ["--block-bytes=-16KiB"]])
def test_a_negative_size_is_named(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "argument --block-bytes: expected one argument"."""
    err = _parse_error(["replay", *words], capsys)
    assert "argument --block-bytes:" in err and "got '-16KiB'" in err
    assert "expected one argument" not in err and len(err.splitlines()) == 1


def test_a_value_that_looks_like_an_option_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["replay", "--namespace-tag", "-mine"], capsys)
    assert "got '-mine', which reads as an option" in err
    assert "--namespace-tag=-mine" in err


@pytest.mark.parametrize(("text", "looks"), [
    ("timestamp,input_length,output_length\n0,512,8\n", "CSV"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "OpenAI-style chat log"),
])
def test_a_trace_in_another_format_names_the_expected_one(
        text: str, looks: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "not valid JSON" / "field 'timestamp': missing", and a --skip-bad-lines hint."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    code, _, err = _run(["replay", str(trace), *FAST], capsys)
    assert code == 2
    assert looks in err and "expected Mooncake JSON Lines" in err and "docs/replay.md" in err
    assert "--skip-bad-lines" not in err


def test_choice_values_have_one_spelling_and_accept_the_other(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --route took only round-robin, --write-policy only write_through."""
    help_text = cli._build_parser()._subparsers._group_actions[0].choices["replay"].format_help()
    assert "round_robin" in help_text and "round-robin" not in help_text
    trace = _trace(tmp_path / "t.jsonl")
    report = tmp_path / "r.json"
    code, _, err = _run(["replay", str(trace), "--route", "round-robin", "--write-policy",
                         "write-back", "--json", str(report), *FAST], capsys)
    assert code == 0, err
    settings = json.loads(report.read_text())["settings"]
    assert settings["route"] == "round_robin" and settings["write_policy"] == "write_back"


# ---- purge -----------------------------------------------------------------------------------

def test_declining_a_purge_exits_0_and_removes_nothing(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 2, as for a bad argument. Answered on a real pseudo-terminal."""
    tier = tmp_path / "tier"
    trace = _trace(tmp_path / "t.jsonl")
    code, _, err = _run(["replay", str(trace), "--tier", tier.as_uri(), "--keep", *FAST], capsys)
    assert code == 0, err
    before = _tree(tier)
    controller, terminal = pty.openpty()
    try:
        os.write(controller, b"n\n")
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "purge", tier.as_uri(), "--namespace",
             "model=kvtier-replay"], stdin=terminal, capture_output=True, text=True,
            timeout=60, env={**os.environ, "PYTHONPATH": str(_SRC)}, check=False)
    finally:
        os.close(terminal)
        os.close(controller)
    assert done.returncode == 0, done.stderr
    assert "declined; nothing removed" in done.stderr
    assert _tree(tier) == before
    refused = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "purge", tier.as_uri(), "--namespace",
         "model=kvtier-replay"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(_SRC)}, check=False)
    assert refused.returncode == 2 and "without --yes" in refused.stderr


# ---- bench serve --help ----------------------------------------------------------------------

def test_bench_serve_help_never_imports_vllm(tmp_path: Path) -> None:
    """A ``vllm`` package that fails on import stands first on the path: --help must not touch
    it (without vLLM, or with a broken one, the help is still there)."""
    poisoned = tmp_path / "vllm"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise ImportError('vllm was imported')\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "serve", "--help"], capture_output=True,
        text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(_SRC)])})
    assert done.returncode == 0, done.stderr
    assert "usage: kvtier bench serve" in done.stdout and done.stderr == ""


def test_a_tier_refused_at_open_is_one_line_and_no_cleanup_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL whose problem only the backend's open finds (the file system's root): before, the
    error came with "removed the 0 blocks (0 B) this run stored in file:///"."""
    trace = _trace(tmp_path / "t.jsonl")
    code, out, err = _run(["replay", str(trace), "--tier", "file:///", *FAST], capsys)
    assert code == 2
    assert out == ""
    assert err.splitlines() == [
        "kvtier replay: error: secondary_tiers[0]: file backend root '/' is the file system's "
        "root; expected a directory of its own, e.g. file:///var/cache/kvtier"]
