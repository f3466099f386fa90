"""The README's pipeline block runs as written (scripts/newcomer.sh), so the README cannot drift from the
code: a fast test parses every command of the block with the real argument parser, a slow one runs it."""
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from nanoeuler.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


def readme_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- newcomer:begin -->\n(.*?)<!-- newcomer:end -->", text, re.S)
    assert m, "README.md lost its newcomer block"
    lines = [ln[4:] if ln.startswith("    ") else ln for ln in m.group(1).splitlines()]
    return [c for c in re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines() if c.strip()]


def test_every_readme_command_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("plays.txt", "tok.json"):        # what the block starts from / makes first
        (tmp_path / name).write_text("x")
    commands = readme_block()
    assert len(commands) >= 10
    seen = set()
    for cmd in commands:
        words = shlex.split(re.split(r"[<>]", cmd)[0], comments=True)   # without redirections
        words = words[words.index("nanoeuler") + 1:]                    # after `echo ... |`
        args = build_parser().parse_args(words)
        assert getattr(args, "run", None), cmd
        seen.add(words[0])
    for stage in ("tokenizer", "prepare", "train", "eval", "sample", "sft", "dpo-data", "dpo", "chat"):
        assert stage in seen, stage


@pytest.mark.skipif(os.environ.get("NANOEULER_SKIP_NEWCOMER") == "1", reason="NANOEULER_SKIP_NEWCOMER=1")
def test_newcomer_script_runs_the_readme_block(tmp_path):
    work = tmp_path / "newcomer"
    r = subprocess.run(["bash", str(REPO / "scripts" / "newcomer.sh"), str(work)], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"all {len(readme_block())} commands passed" in r.stdout
    for path in ("tok.json", "hf.json", "ids.txt", "data/mine/manifest.json", "data/mine/tokenizer.json",
                 "runs/mine/model.safetensors", "runs/mine-sft/model.safetensors", "data/dpo/pairs_train.jsonl",
                 "runs/mine-dpo/model.safetensors"):
        assert (work / path).exists(), path
    assert "Traceback" not in r.stderr
