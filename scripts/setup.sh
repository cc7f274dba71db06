#!/usr/bin/env bash
# Create .venv with the pinned toolchain; do nothing when requirements.txt has not changed since.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -f .venv/.requirements.sha256 ] && [ "$(cat .venv/.requirements.sha256)" = "$want" ] && [ -x .venv/bin/doit ]; then
  exit 0
fi
"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"Python 3.11 is required (torch 2.14.1 and the TensorFlow 2.19 stack are pinned for it), found {sys.version.split()[0]}")
PY
[ -d .venv ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
echo "$want" > .venv/.requirements.sha256
echo "setup: .venv ready"
