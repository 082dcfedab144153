#!/usr/bin/env bash
# The GPU suite in one call of the device machine: every step, its figures in $OUT (suite.json,
# suite.md, suite.log). How to call it, what it measures and what each figure means:
# benchmarks/gpu/suite.py's docstring. Extra arguments go to the suite (--dry-run rehearses it on a CPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu/suite.py "$@"
