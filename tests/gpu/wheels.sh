#!/usr/bin/env bash
# Wheels for the lent GPU machine, whose image (Python 3.12, its own CUDA torch, lightning) lacks
# what Oases needs beside torch: deepspeed, hydra-core, omegaconf, antlr4, pydantic and their
# few dependencies (../.library/device/KINDS.md lists what is there).  Run here, once, in the
# repository root; then name .whl in the device call's `carry` and start its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection annotated-types typing-extensions hydra-core==1.3.8 \
  omegaconf==2.3.1 hjson
# sdist-only (pure Python): built into wheels here; deepspeed builds without compiling its ops
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
ls -la .whl
du -sh .whl
