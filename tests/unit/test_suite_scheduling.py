"""How the suite splits over its two pytest-xdist workers (``tests/xdist_split.py``): every test
of a tier that starts ranks on one worker, one after another; every other module whole on a worker."""
import xdist_split


def test_the_tiers_that_start_ranks_share_one_scope_and_other_modules_keep_their_own():
    ranks = {xdist_split.scope(nodeid) for nodeid in (
        "tests/distributed/test_parity.py::test_gradients_and_losses_match_reference[none-gpt-tp4]",
        "tests/integration/test_cli_errors.py::test_bad_override_is_one_line",
        "tests/gpu/test_gpu.py::test_smoke")}
    assert ranks == {xdist_split.RANKS_SCOPE}
    assert xdist_split.scope("tests/unit/test_random.py::test_mask_rate[0.1]") == "tests/unit/test_random.py"
    assert xdist_split.scope("tests/unit/test_random.py::TestX::test_y") == "tests/unit/test_random.py"


def test_a_run_of_named_files_or_tests_stays_in_this_process():
    def workers(*args: str) -> int:
        return xdist_split.workers(list(args))

    assert workers() == 2  # the suite (testpaths)
    assert workers("tests/unit") == 2 and workers("tests/unit", "tests/distributed/test_fp16.py") == 2
    assert workers("tests/unit/test_random.py") == 0
    assert workers("tests/unit/test_random.py::test_mask_rate", "tests/distributed/test_fp16.py") == 0
