"""BERT padding: with ``attention_mask`` in the batch no query reads a padding key, so a
right-padded sample gives the loss and gradients it gives unpadded (fp32, 1e-5 relative),
eagerly and through the Oases schedule, at TMP 1 (in process) and TMP 2 (gloo ranks)."""
import pytest

import dist_workers
from oases_ds.launcher import launch

TOL = 1e-5


def _check(r: dict) -> None:
    for key in ("eager", "scheduled"):
        assert abs(r[key] - r["ref"]) <= TOL * abs(r["ref"]), (key, r)
    assert r["eager_grad_err"] <= TOL and r["sched_grad_err"] <= TOL, r
    assert abs(r["unmasked"] - r["ref"]) > TOL * abs(r["ref"]), r  # without the mask this test would fail


def test_padded_sample_equals_unpadded_tmp1():
    _check(dist_workers.padding_mask_worker(1))


@pytest.mark.distributed
def test_padded_sample_equals_unpadded_tmp2():
    for r in launch(dist_workers.padding_mask_worker, 2, (2,), timeout_s=600):
        _check(r)
