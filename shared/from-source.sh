#!/usr/bin/env bash
# Run a command against the packages' source folders, with nothing installed (e.g. on a GPU box
# with torch and triton but no network): every src/ folder goes on PYTHONPATH.
#   bash shared/from-source.sh python -m pytest shared/tests packages tests   # the tests
#   bash shared/from-source.sh python -m fk_runtime                           # the main job
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
paths="$root/shared/src"
for src in "$root"/packages/*/src; do paths="$paths:$src"; done
export PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$@"
