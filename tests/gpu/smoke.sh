#!/usr/bin/env bash
# One GPU smoke run (tests/gpu/smoke.py says what each step checks): at most 10 minutes on one
# H200, every step under its own timeout, all results in $OUT/gpu_smoke.json (default: /tmp).
# Without CUDA it still runs, skipping the CUDA steps with their reason, and exits 0.
#   bash tests/gpu/smoke.sh                 # OUT=/tmp
#   OUT=results bash tests/gpu/smoke.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
timeout 600 "${PYTHON:-python3}" tests/gpu/smoke.py --out "$OUT"
