"""How the suite splits over two pytest-xdist workers (``conftest.py`` hands xdist these).

The tiers that start ranks (``distributed/``, ``integration/``) run one test after another on
one worker, as they would without xdist: each launch sizes its ranks for the host's cores, and
two launches at once would slow each other past what the tests were tuned for.  The unit tier's
modules run on the second worker meanwhile, in the CPU time the ranks leave idle while they wait
on each other (measured: 18% of 2 cores).  A module stays whole on one worker, so its
module-scoped fixtures and caches run once.  By directory, not by the ``distributed`` marker: a
test that runs ``oases-train`` in its own process to see a refusal starts a fork server too.

(A scheduler of our own, not ``--dist loadgroup``: xdist 3.8 marks a group by renaming the
test's node id, which pytest 9.2 no longer lets it do, so every group was silently spread over
both workers.)
"""
from __future__ import annotations

RANKS_SCOPE = "tiers-that-start-ranks"
RANKS_TIERS = ("distributed", "integration", "gpu")


def scope(nodeid: str) -> str:
    """The unit of work a worker takes whole: ``RANKS_SCOPE`` for a test of a tier that starts
    ranks, its module's path for any other test."""
    module = nodeid.split("::")[0]
    parts = module.split("/")
    tier = parts[1] if parts[0] == "tests" and len(parts) > 2 else parts[0]
    return RANKS_SCOPE if tier in RANKS_TIERS else module


def workers(args: list[str]) -> int:
    """2 for a run of directories (the suite, a tier); 0 (one process, where ``-s`` and
    ``--pdb`` work) when every argument names a test file or a test: a second worker would have
    nothing to overlap."""
    named = [arg for arg in args if arg.split("::")[0].endswith(".py")]
    return 0 if args and len(named) == len(args) else 2
