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


# Two pytest-xdist workers (pytest.ini: ``-n auto``).  The tiers that start ranks
# (``distributed/``, ``integration/``) run one test after another on one worker, as they would
# without xdist: each launch sizes its ranks for the host's cores, and two launches at once
# would slow each other past what the tests were tuned for.  The unit tier's modules run on the
# second worker meanwhile, in the CPU time the ranks leave idle while they wait on each other
# (measured: 18% of 2 cores).  A module stays whole on one worker, so its module-scoped
# fixtures and caches run once.  By directory, not by the ``distributed`` marker: a test that
# runs ``oases-train`` in this process to see a refusal starts a fork server too.  (A scheduler
# of our own, not ``--dist loadgroup``: xdist 3.8 marks a group by renaming the test's node id,
# which pytest 9.2 no longer lets it do, so every group was silently spread over both workers.)
RANKS_SCOPE = "tiers-that-start-ranks"
RANKS_TIERS = ("distributed", "integration", "gpu")


def xdist_scope(nodeid: str) -> str:
    """The unit of work a worker takes whole: ``RANKS_SCOPE`` for a test of a tier that starts
    ranks, its module's path for any other test."""
    module = nodeid.split("::")[0]
    parts = module.split("/")
    tier = parts[1] if parts[0] == "tests" and len(parts) > 2 else parts[0]
    return RANKS_SCOPE if tier in RANKS_TIERS else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """2 for a run of directories (the suite, a tier); 0 (this process, ``-s`` and ``--pdb``
    work) when every argument names a test file or a test, where a second worker has nothing
    to overlap."""
    named = [arg for arg in config.args if arg.split("::")[0].endswith(".py")]
    return 0 if config.args and len(named) == len(config.args) else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scheduler by scope (the largest scope first), with ``xdist_scope``'s scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return TierScheduling(config, log)
