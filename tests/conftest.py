import os
import sys

# Rank processes (spawned) inherit sys.path, so helper modules in tests/ are importable there.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# CPU ranks over gloo even on a GPU host (oases_ds.parallel.context.resolve_backend): the CPU
# tiers then run unchanged there, several ranks per GPU included; tests/gpu/ choose their own.
os.environ.setdefault("OASES_BACKEND", "gloo")

# Ranks fork from a fork server on CPU builds of torch (oases_ds.launcher.start_method): have
# it import the modules whose functions the tests launch, so no rank imports them itself.
from oases_ds import launcher  # noqa: E402

launcher.preload("dist_workers", "engine_workers", "fault_workers", "hf_workers", "lightning_workers",
                 "pipeline_workers", "portable_workers", "reference_models",
                 # imported inside the HF and Lightning workers: once here, not by each of their ranks
                 "transformers", "lightning.pytorch")
