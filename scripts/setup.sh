#!/usr/bin/env bash
# Create .venv with the pinned toolchain; do nothing when requirements.txt has not changed since.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
# espeak-ng and sox make the real speech that speech validation, calibration and tests use; OpenSSH's sshd
# stands in for a board in the on-board runner's tests (tools/board.py).
missing=$(for pair in espeak-ng:espeak-ng sox:sox sshd:openssh-server; do
  tool=${pair%%:*}
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || echo "${pair##*:}"
done)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "setup: please install $(echo $missing) (Debian/Ubuntu: sudo apt-get install $(echo $missing))" >&2
    exit 1
  fi
fi
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
