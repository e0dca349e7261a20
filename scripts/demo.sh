#!/usr/bin/env bash
# The main job: a short demo of what safeattn gives (python -m safeattn demo).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -m safeattn demo "$@"
