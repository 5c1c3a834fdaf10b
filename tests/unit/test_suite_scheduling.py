"""How the suite splits over its two pytest-xdist workers (``tests/conftest.py``): every test of
a tier that starts ranks on one worker, one after another; every other module whole on a worker."""
from types import SimpleNamespace

import conftest


def test_the_tiers_that_start_ranks_share_one_scope_and_other_modules_keep_their_own():
    ranks = {conftest.xdist_scope(nodeid) for nodeid in (
        "tests/distributed/test_parity.py::test_gradients_and_losses_match_reference[none-gpt-tp4]",
        "tests/integration/test_cli_errors.py::test_bad_override_is_one_line",
        "tests/gpu/test_gpu.py::test_smoke")}
    assert ranks == {conftest.RANKS_SCOPE}
    assert conftest.xdist_scope("tests/unit/test_random.py::test_mask_rate[0.1]") == "tests/unit/test_random.py"
    assert conftest.xdist_scope("tests/unit/test_random.py::TestX::test_y") == "tests/unit/test_random.py"


def test_a_run_of_named_files_or_tests_stays_in_this_process():
    def workers(*args: str) -> int:
        return conftest.pytest_xdist_auto_num_workers(SimpleNamespace(args=list(args)))

    assert workers() == 2  # the suite (testpaths)
    assert workers("tests/unit") == 2 and workers("tests/unit", "tests/distributed/test_fp16.py") == 2
    assert workers("tests/unit/test_random.py") == 0
    assert workers("tests/unit/test_random.py::test_mask_rate", "tests/distributed/test_fp16.py") == 0
