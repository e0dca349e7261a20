#!/usr/bin/env bash
# The main job: a short demo of what safeattn gives (python -m safeattn demo).
set -euo pipefail
cd "$(dirname "$0")/.."
# Built for this machine's GPUs only (none: no CUDA code), unless a full build of these sources
# is already there (scripts/env.sh).
SAFEATTN_FOR_THIS_MACHINE=1 source scripts/env.sh
python -m safeattn demo "$@"
