import os
import sys

# Rank processes (spawned) inherit sys.path, so helper modules in tests/ are importable there.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
