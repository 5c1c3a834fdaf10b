import logging
import os
import sys
from collections.abc import Iterator

import pytest

# Rank processes (spawned) inherit sys.path, so helper modules in tests/ are importable there.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# CPU ranks over gloo even on a GPU host (oases_ds.parallel.context.resolve_backend): the CPU
# tiers then run unchanged there, several ranks per GPU included; tests/gpu/ choose their own.
os.environ.setdefault("OASES_BACKEND", "gloo")

import xdist_split  # noqa: E402  (from tests/, just put on the path)

# Ranks fork from a fork server on CPU builds of torch (oases_ds.launcher.start_method): have
# it import the modules whose functions the tests launch, so no rank imports them itself.
from oases_ds import launcher  # noqa: E402

launcher.preload("dist_workers", "engine_workers", "fault_workers", "hf_workers", "lightning_workers",
                 "pipeline_workers", "portable_workers", "reference_models",
                 # imported inside the HF and Lightning workers: once here, not by each of their ranks
                 "transformers", "lightning.pytorch")


@pytest.fixture(autouse=True)
def loggers_left_enabled() -> Iterator[None]:
    """Each logger enabled or disabled after a test as before it.  A test that runs a Hydra entry
    point in this process (``oases-plan``'s ``main``) leaves Hydra's logging configuration
    behind, which disables every logger that existed then (``disable_existing_loggers``): the
    ``oases_ds`` logger then logs nothing, and a later ``caplog`` test fails in one order of
    the tests and passes in another."""
    loggers = logging.Logger.manager.loggerDict
    before = {name: lg.disabled for name, lg in loggers.items() if isinstance(lg, logging.Logger)}
    yield
    for name, lg in list(loggers.items()):
        if isinstance(lg, logging.Logger):
            lg.disabled = before.get(name, False)


# Two pytest-xdist workers (pytest.ini: ``-n auto``): the rank-starting tiers on one, the unit
# tier beside them (``xdist_split`` says how and why).
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return xdist_split.workers(config.args)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scheduler by scope (the largest scope first), with ``xdist_split.scope``'s scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_split.scope(nodeid)

    return TierScheduling(config, log)
