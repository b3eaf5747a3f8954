#!/usr/bin/env bash
# Regenerate requirements-lock.txt: the exact versions the test suite last passed with.
#   bash scripts/lock_requirements.sh        (from the repository root; takes as long as the suite)
# A brand-new virtual environment gets requirements.txt at the newest versions its floors allow,
# the suite runs in it, and only if it passes is `pip freeze` written to the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
unset PYTHONPATH
export PYTHONNOUSERSITE=1
python -m pip install --quiet --disable-pip-version-check torch==2.13.0  # see .ci/run
python -m pip install --quiet --disable-pip-version-check -r requirements.txt
python -m pytest -q
{
  echo "# Exact versions the test suite last passed with (Python $(python -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d))."
  echo "# Regenerate: bash scripts/lock_requirements.sh. Install: pip install -r requirements-lock.txt"
  echo "# (torch is the CPU build there; on a GPU machine pip takes the CUDA build of the same version)"
  python -m pip freeze --disable-pip-version-check | sed -E 's/\+cpu$//'
} > requirements-lock.txt
echo "wrote requirements-lock.txt ($(grep -vc '^#' requirements-lock.txt) packages)"
