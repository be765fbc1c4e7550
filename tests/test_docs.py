"""Every shell and Python block of the README and of docs/*.md runs as written.

The blocks of a page run in order, in one fresh directory (so `run`'s samples.jsonl is there for
`trace`), with this checkout importable and `python` the interpreter running the tests. A marker
on the line before a block says what else it is:

    <!-- file: NAME -->        the block is the content of the file NAME (written, not run)
    <!-- needs: slime ... -->  skipped: needs slime's cluster (also: gpu, network, root, ray)
    <!-- needs: long ... -->   runs only with DOCS_LONG=1 (minutes)
    <!-- needs: background --> started and left running (a server); the URL it prints on its
                               "listening on" line is handed to later blocks as SGLANG_URL
    <!-- needs: serve -->      needs such a server (started earlier on the page)

Any other marker fails the test, so a typo never skips a block. New pages under docs/ are
found by themselves: a block that cannot run yet must say why with a marker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"bash", "sh", "shell", "python"}
SKIPPED = {"slime", "gpu", "network", "root", "ray"}
KNOWN = SKIPPED | {"long", "background", "serve"}
MARKER = re.compile(r"<!--\s*(needs|file):\s*([^\s>]+)[^>]*-->")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


@attrs.frozen
class Block:
    page: str
    line: int
    lang: str
    text: str
    needs: str | None
    file: str | None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the marker on the line before each (if any)."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        kind, value = (marker.group(1), marker.group(2)) if marker else (None, None)
        found.append(Block(page.name, text[: m.start()].count("\n") + 1, m.group(1), m.group(2),
                           value if kind == "needs" else None, value if kind == "file" else None))
    return found


def test_the_readme_blocks_are_found_and_every_marker_is_known() -> None:
    readme = blocks(ROOT / "README.md")
    assert sum(b.lang in RUNNABLE and not b.needs and not b.file for b in readme) >= 5
    assert {b.file for b in readme if b.file} >= {"mytools.py", "myformat.py", "engine.yaml"}
    for page in PAGES:
        for b in blocks(page):
            assert b.needs is None or b.needs in KNOWN, f"{b.page}:{b.line}: unknown marker needs: {b.needs}"


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(ROOT)])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _start(block: Block, cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Start a background block; wait for its "listening on URL" line."""
    proc = subprocess.Popen(["bash", "-c", "exec " + block.text.strip()], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        url = re.search(r"listening on (http://\S+)", line)
        if url:
            return proc, url.group(1)
    proc.kill()
    raise AssertionError(f"{block.page}:{block.line}: the background block never said where it listens: {''.join(seen)}")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_of_the_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    env = _env(tmp_path)
    started: list[subprocess.Popen[str]] = []
    skipped: list[str] = []
    try:
        for b in blocks(page):
            where = f"{b.page}:{b.line}"
            if b.file:
                (tmp_path / b.file).write_text(b.text, encoding="utf-8")
                continue
            if b.lang not in RUNNABLE:
                continue
            if b.needs in SKIPPED or (b.needs == "long" and os.environ.get("DOCS_LONG") != "1"):
                skipped.append(f"{where} ({b.needs})")
                continue
            if b.needs == "background":
                proc, url = _start(b, tmp_path, env)
                started.append(proc)
                env["SGLANG_URL"] = url
                continue
            if b.needs == "serve":
                assert "SGLANG_URL" in env, f"{where}: needs a server, and no background block started one before it"
            if b.lang == "python":
                script = tmp_path / f"block_{b.line}.py"
                script.write_text(b.text, encoding="utf-8")
                argv = [sys.executable, str(script)]
            else:
                argv = ["bash", "-euo", "pipefail", "-c", b.text]
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            assert "Traceback" not in done.stderr, f"{where}:\n{done.stderr[-3000:]}"
    finally:
        for proc in started:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if skipped:
        print("not run here:", ", ".join(skipped))
