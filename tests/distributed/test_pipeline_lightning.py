"""Trainer(strategy="oases") with pipeline stages: 2 CPU processes as 2 stages (TMP 1) against the
same Trainer with TMP 2 and one stage, both 1 epoch of accumulate_grad_batches=2 with gradient
clipping.  Both are exact against the unsharded model, so each stage's parameters must match
the TMP 2 run's to fp32 relative error <= 1e-5, and the logged losses too."""
import pytest

import pipeline_workers as pw
from oases_ds.launcher import launch

pytestmark = pytest.mark.distributed
TOL = 1e-5


def test_trainer_with_two_stages_matches_the_one_stage_trainer(tmp_path):
    per_rank = launch(pw.lightning_pipeline_run, 2, (str(tmp_path),), timeout_s=600, threads_per_rank=1)
    held: set = set()
    for rank, out in enumerate(per_rank):
        pp, tmp = out["pp2"], out["tmp2"]
        assert pp["layout"] == (2, 1, 1) and tmp["layout"] == (1, 2, 1)
        assert pp["sampler"] == {"num_replicas": 1, "rank": 0}  # both stages read the same samples
        assert pp["global_step"] == tmp["global_step"] == 2
        assert pp["losses"] == pytest.approx(tmp["losses"], rel=TOL)
        assert pp["val_losses"] == pytest.approx(tmp["val_losses"], rel=TOL)
        for name, got in pp["params"].items():
            want = tmp["params"][name]
            err = float((got - want).norm() / want.norm())
            assert err <= TOL, f"rank {rank} {name}: rel err {err:.2e}"
        held |= set(pp["params"])
    assert held == set(per_rank[0]["tmp2"]["params"])
