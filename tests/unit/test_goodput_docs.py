"""docs/goodput.md quotes `tpassctl goodput` output: each quoted block is what the command prints.

A block is a fenced block whose first line is ``$ tpassctl goodput ARGS``; the rest is the output
(stdout, then the notes on stderr, as a terminal shows them), run here from the repository root.
After a change to the model, the presets or the bench results it quotes, rewrite the blocks with
``.venv/bin/python tests/unit/test_goodput_docs.py --write`` and read the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tpassctl.goodput_cmd import goodput

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "goodput.md"
PROMPT = "$ tpassctl goodput"
BLOCK = re.compile(r"^```\n(\$ tpassctl goodput[^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def quoted_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def output_of(command: str) -> str:
    """What the quoted command prints, run from the repository root."""
    args = shlex.split(command[len(PROMPT):])
    here = Path.cwd()
    os.chdir(REPO)  # --measured paths in the doc are relative to the repository
    try:
        result = CliRunner().invoke(goodput, args, catch_exceptions=False)
    finally:
        os.chdir(here)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_doc_quotes_the_commands_it_discusses():
    commands = [c for c, _ in quoted_blocks(DOC.read_text())]
    assert f"{PROMPT} --preset llama3-16k" in commands
    assert any("--solve-breakeven" in c for c in commands)
    assert any("--measured" in c for c in commands)


@pytest.mark.parametrize("command, quoted", quoted_blocks(DOC.read_text()), ids=lambda x: x[:90])
def test_each_quoted_block_is_the_commands_output(command, quoted):
    assert output_of(command) == quoted, f"docs/goodput.md's block for `{command}` is stale: {__doc__}"


def write() -> int:
    text = DOC.read_text()
    new = BLOCK.sub(lambda m: f"```\n{m.group(1)}\n{output_of(m.group(1))}```", text)
    DOC.write_text(new)
    print(f"{DOC}: {len(quoted_blocks(new))} blocks, {'rewritten' if new != text else 'unchanged'}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write   (rewrites the quoted blocks in {DOC})")
    sys.exit(write())
