#!/usr/bin/env bash
# Every GPU check in one command (issue 22 item 9); the logic is in validate.py.
#
#   bench/gpu/validate.sh [--dry-run] [--budget-s 470]
#
# Results: one JSON file per part plus summary.json in $OUT (default ./gpu-results).
# Never changes MIG mode, never resets the GPU; MIG inventory is read only.  Without a GPU
# (or with --dry-run) it writes what it skipped and exits 0.  Exit 1 if any part failed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$here/validate.py" "$@"
