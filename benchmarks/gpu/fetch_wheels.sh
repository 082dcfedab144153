#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu/wheels.txt for the device machine, here (the device machine
# reaches no registry): CPython 3.12 on manylinux x86-64, wheels only, no dependencies (every one it
# needs is listed by name). The pip flags are the device notes' recipe.
#
#   bash benchmarks/gpu/fetch_wheels.sh            # into .whl/ at the repository root, kept out of git
#   bash benchmarks/gpu/fetch_wheels.sh DIR        # into DIR (tests/test_gpu_suite.py does this)
#
# The folder is left holding these wheels alone: one version of each name, since two stop the install
# there. PYTHON names the interpreter whose pip downloads (default python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="${1:-$root/.whl}"
python="${PYTHON:-python3}"

mkdir -p "$dest"
if [ "$#" -eq 0 ]; then
  # The default folder travels with `carry: [".whl"]`; excluded, git never offers to commit it.
  exclude="$(git -C "$root" rev-parse --git-path info/exclude 2>/dev/null || true)"
  if [ -n "$exclude" ]; then
    case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
  fi
fi
rm -f "$dest"/*.whl

# NAME==VERSION of every line that is not a comment.
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$here/wheels.txt" | grep -v '^$')
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"

count="$(find "$dest" -maxdepth 1 -type f -name '*.whl' | wc -l)"
if [ "$count" -ne "${#pins[@]}" ]; then
  echo "fetch_wheels: ${#pins[@]} pins but $count wheels in $dest" >&2
  exit 1
fi
echo "fetch_wheels: $count wheels, $(du -ch "$dest"/*.whl | tail -1 | cut -f1) in $dest"
