"""Every command block of README.md, deploy/README.md and docs/rl.md is either run here, as a reader would
paste it into a shell, or says on its first line what it needs that this machine lacks
(`# needs: ...`). So the docs cannot drift from what the commands do.

A block runs with bash (`set -euo pipefail`) from the repository root, with the venv's
programs on PATH (the READMEs start with `make setup`), its own process group (every
background process is stopped afterwards), each `:PORT` replaced by a free port (the same
port for the same number throughout the block) and `/tmp/` by a temporary directory, so blocks
run beside other test runs. A curl must carry -f (--fail): curl exits 0 on an HTTP error
otherwise, and the block would pass while the server refused the request."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit import demo
from tests.deploy.conftest import ROOT
from tests.e2e_helpers import free_port

pytestmark = pytest.mark.slow(17)

DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", ROOT / "docs" / "rl.md"]
SHELLS = ("sh", "bash", "shell", "console")
# What a block may declare it needs (first line `# needs: ...`): what this machine and CI lack.
LACKS = (
    "a GPU",
    "a Kubernetes cluster",
    "a Docker engine",
    "systemd as the init system",
    "a published release",
    "protoc with the protoc-gen-go",
)
# Commands run elsewhere, not by pasting them here: `make test` is the suite itself (CI runs
# it), and each `make run ENGINE=...` is run by tests/deploy/test_demos.py.
ELSEWHERE = re.compile(r"^make (test|run( ENGINE=[\w-]+)?)\b")
# Far above what any block needs (seconds); never hit when green.
BLOCK_WAIT = 300.0
STOP_WAIT = 30.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    language: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def commands(self) -> list[str]:
        return [ln for ln in self.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]

    @property
    def needs(self) -> str | None:
        first = self.text.splitlines()[0] if self.text else ""
        found = re.match(r"#\s*needs:\s*(.+)", first)
        return found.group(1) if found else None


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[index])
        if opening:
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            found.append(Block(path, index + 1, opening.group(1), "\n".join(lines[index + 1 : end])))
            index = end
        index += 1
    return found


ALL = [block for path in DOCS for block in blocks(path)]
COMMANDS = [b for b in ALL if b.language in SHELLS]
DECLARED = [b for b in COMMANDS if b.needs is not None]
ELSEWHERE_BLOCKS = [b for b in COMMANDS if b.needs is None and all(ELSEWHERE.match(c) for c in b.commands)]
RUN = [b for b in COMMANDS if b.needs is None and b not in ELSEWHERE_BLOCKS]


def test_every_block_says_its_language() -> None:
    # An unlabelled block could be a command block that slipped through.
    for block in ALL:
        assert block.language, f"{block.name}: a ``` block without a language"


def test_the_docs_have_command_blocks_of_every_kind() -> None:
    assert RUN
    assert DECLARED
    assert ELSEWHERE_BLOCKS


@pytest.mark.parametrize("block", DECLARED, ids=lambda b: b.name)
def test_a_block_not_run_says_what_it_needs(block: Block) -> None:
    assert block.needs is not None
    assert any(lack in block.needs for lack in LACKS), f"{block.name}: needs {block.needs!r}"


@pytest.mark.parametrize("block", ELSEWHERE_BLOCKS, ids=lambda b: b.name)
def test_make_run_and_make_test_blocks_are_run_elsewhere(block: Block) -> None:
    for command in block.commands:
        engine = re.search(r"ENGINE=([\w-]+)", command)
        if engine:
            assert engine.group(1) in demo.DEMOS, command


def _prepared(block: Block, tmp: Path) -> str:
    ports: dict[str, int] = {}

    def port(match: re.Match[str]) -> str:
        ports.setdefault(match.group(1), free_port())
        return f":{ports[match.group(1)]}"

    text = re.sub(r":(\d{4,5})\b", port, block.text)
    return text.replace("/tmp/", f"{tmp}/")


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to everything the block started (its process group), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            # The group is gone once its last member exits; bash itself has exited already.
            subprocess.run(
                ["bash", "-c", f"while kill -0 -- -{proc.pid} 2>/dev/null; do sleep 0.1; done"],
                timeout=STOP_WAIT,
                check=False,
            )
            return
        except subprocess.TimeoutExpired:
            continue


# What only a block that says what it needs may do: change this machine outside the sandbox.
SYSTEM_CHANGES = re.compile(
    r"\bsudo\b|\binstall-systemd\b|\binstall -m\b|\bsystemctl\b|\bkubectl\b|\bdocker\b"
    r"|(?<![\w.])/(etc|opt|usr|var)/"
)


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_each_command_block_runs(block: Block, tmp_path: Path) -> None:
    changes = SYSTEM_CHANGES.search(block.text)
    assert changes is None, f"{block.name} would run {changes.group(0)!r} here: mark it `# needs: ...`"
    for command in block.commands:
        if command.startswith("curl"):
            assert re.search(r"(^|\s)-\w*f\w*\b|--fail", command), f"{block.name}: curl without -f: {command}"
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + _prepared(block, tmp_path) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    log = tmp_path / "block.log"
    # Output to a file, not a pipe: the block's background processes outlive bash and would
    # hold a pipe open.
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=BLOCK_WAIT)
        finally:
            _stop_group(proc)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0, f"{block.name} failed ({code}):\n{log.read_text()}"
