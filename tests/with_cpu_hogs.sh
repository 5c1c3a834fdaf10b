#!/usr/bin/env bash
# Run a command (default: the whole test suite) with busy-loop CPU hogs beside it, to show the
# suite does not depend on the host's speed or idleness (issue 39: earlier CI reds were all
# load-dependent tests that passed alone).  The hogs end with this script, however it ends.
#
#   bash tests/with_cpu_hogs.sh                        # 2 hogs, python -m pytest
#   HOGS=3 bash tests/with_cpu_hogs.sh python -m pytest tests/distributed -x
set -euo pipefail
hogs=${HOGS:-2}
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for _ in $(seq "$hogs"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
echo "with_cpu_hogs: $hogs busy-loop processes (${pids[*]}) beside: ${*:-python -m pytest}" >&2
if [ "$#" -eq 0 ]; then set -- python -m pytest; fi
"$@"
