import os
import sys

# Rank processes (spawned) inherit sys.path, so helper modules in tests/ are importable there.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# CPU ranks over gloo even on a GPU host (oases_ds.parallel.context.resolve_backend): the CPU
# tiers then run unchanged there, several ranks per GPU included; tests/gpu/ choose their own.
os.environ.setdefault("OASES_BACKEND", "gloo")
