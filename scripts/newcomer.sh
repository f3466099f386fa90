#!/usr/bin/env bash
# The newcomer path: run README.md's pipeline block (between <!-- newcomer:begin --> and
# <!-- newcomer:end -->) literally, in a fresh directory, on 400 KB of the bundled plays as `plays.txt`.
# The commands are read from the README itself, so the README cannot drift from the code.
# README_BLOCK=bring runs the "Bring a model" walk-through instead (<!-- bring:begin --> ...), on the
# published models `make models` put in the repository's .cache/models, or in $NANOEULER_MODELS (linked
# into the directory as .cache/models).
#
#   scripts/newcomer.sh            # in a temporary directory, removed afterwards
#   scripts/newcomer.sh DIR        # in DIR (kept), e.g. to look at the runs afterwards
#   README_BLOCK=bring scripts/newcomer.sh
#
# Uses ./.venv/bin/nanoeuler when the repository has one (what `make` sets up), else nanoeuler on PATH.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ -x "$repo/.venv/bin/nanoeuler" ]; then export PATH="$repo/.venv/bin:$PATH"; fi
command -v nanoeuler >/dev/null || { echo "error: nanoeuler is not installed (run make first)" >&2; exit 2; }

name="${README_BLOCK:-newcomer}"
block="$(awk -v b="$name" '$0 == "<!-- " b ":begin -->" {on=1; next} $0 == "<!-- " b ":end -->" {on=0} on' \
         "$repo/README.md" | sed -e 's/^    //')"
if [ -z "$block" ]; then echo "error: README.md has no $name block" >&2; exit 2; fi

if [ $# -ge 1 ]; then work="$1"; mkdir -p "$work"; else work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT; fi
cd "$work"
if [ -n "$(ls -A .)" ]; then echo "error: $work is not empty" >&2; exit 2; fi
models="${NANOEULER_MODELS:-$repo/.cache/models}"   # where the tests find them too (tests/real_models.py)
if [ -d "$models" ]; then mkdir .cache && ln -s "$(cd "$models" && pwd)" .cache/models; fi
python_bin="$(dirname "$(command -v nanoeuler)")/python"
[ -x "$python_bin" ] || python_bin=python3
"$python_bin" - <<'PY'
from nanoeuler.data.corpus import bundled_works
works = bundled_works()
open("plays.txt", "w", encoding="utf-8").write("".join(works[n] for n in sorted(works)[:3])[:400_000])
PY

export TQDM_DISABLE=1   # no progress bars in the transcript
echo "== running README.md's $name block in $work"
n=0
while IFS= read -r cmd; do
  n=$((n + 1))
  echo "== [$n] $cmd"
  start=$SECONDS
  bash -euo pipefail -c "$cmd"
  echo "== [$n] ok in $((SECONDS - start)) s"
done < <(printf '%s\n' "$block" | sed -e ':a' -e '/\\$/N; s/\\\n[[:space:]]*/ /; ta' | grep -v '^[[:space:]]*$')
echo "== $name block: all $n commands passed"
