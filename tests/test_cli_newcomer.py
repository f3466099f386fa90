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


def readme_block(name: str = "newcomer") -> list[str]:
    text = (REPO / "README.md").read_text()
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert m, f"README.md lost its {name} block"
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


def test_every_bring_a_model_command_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = set()
    for cmd in readme_block("bring"):
        if not cmd.split("#")[0].strip() or "nanoeuler" not in cmd:
            continue   # a plain shell line (head)
        words = shlex.split(re.split(r"[<>]", cmd)[0], comments=True)
        words = words[words.index("nanoeuler") + 1:]
        assert getattr(build_parser().parse_args(words), "run", None), cmd
        seen.add(words[0])
    assert {"import", "chat", "sft", "lora", "dpo-data", "dpo", "export"} <= seen


@pytest.mark.skipif(os.environ.get("NANOEULER_SKIP_NEWCOMER") == "1", reason="NANOEULER_SKIP_NEWCOMER=1")
def test_the_bring_a_model_walk_through_runs_on_smollm2(tmp_path):
    """README's "Bring a model" block on SmolLM2 as written (scripts/newcomer.sh, README_BLOCK=bring); then its
    results where they go: llama.cpp loads the Q8_0 export and decodes greedily as we decode that file (until a
    near tie: tests/test_real_models.py), and PEFT puts the DPO adapters onto transformers' load of their base
    to our merged model's logits."""
    from real_models import models_dir, real_model
    real_model("smollm2")
    work = tmp_path / "bring"
    env = os.environ | {"README_BLOCK": "bring", "TQDM_DISABLE": "1"}
    r = subprocess.run(["bash", str(REPO / "scripts" / "newcomer.sh"), str(work)], capture_output=True, text=True,
                       timeout=3600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"all {len(readme_block('bring'))} commands passed" in r.stdout and "Traceback" not in r.stderr
    assert models_dir().exists()
    check_llama_cpp(work)
    check_peft(work)


def check_llama_cpp(work: Path) -> None:
    import numpy as np

    pytest.importorskip("llama_cpp")
    from nanoeuler.cli.sample import load_for_decoding
    from nanoeuler.infer.session import generate
    from nanoeuler.interop.llamacpp import LlamaCpp
    from types import SimpleNamespace
    path = work / "smol-tuned.gguf"
    model, tok = load_for_decoding(SimpleNamespace(ckpt=str(path), dtype=None))
    ids = tok.encode("The capital of France is")
    theirs, _ = LlamaCpp(path, n_ctx=64).greedy(ids, 16)
    mine = generate(model, ids, 16, temperature=0, stop_ids=[]).ids
    same = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), 16)
    print(f"\n[bring] llama.cpp and ours on smol-tuned.gguf: the first {same} of 16 greedy tokens equal")
    assert same >= 4 and len(set(np.array(mine))) > 1


def check_peft(work: Path) -> None:
    import numpy as np

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from nanoeuler import Model
    from nanoeuler.cli import main
    assert main(["export", "--ckpt", str(work / "runs/smol-sft"), "--format", "hf", "--out", str(work / "sft-hf"),
                 "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "sft-hf", torch_dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, work / "smol-dpo-peft")
    ids = np.random.default_rng(0).integers(0, 49152, (1, 24))
    with torch.no_grad():
        theirs = pm(input_ids=torch.from_numpy(ids)).logits.numpy()[0]
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    ours = Model.load(work / "runs/smol-tuned", read_only=True).logits(ids)[0][0]
    base = Model.load(work / "runs/smol-sft", read_only=True).logits(ids)[0][0]
    print(f"[bring] PEFT's adapters on transformers' base against our merged model: relative L2 "
          f"{rel(ours, theirs):.1e} (the base alone: {rel(base, theirs):.1e})")
    assert rel(ours, theirs) < 1e-5 and rel(base, theirs) > 10 * rel(ours, theirs)
