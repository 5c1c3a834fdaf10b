"""Bytes of TMP AllReduce per phase: Megatron 3 per block, Oases (fine-grained) 2."""
import pytest

import dist_workers
from oases_ds.launcher import launch


@pytest.fixture(scope="module")
def stats():
    return launch(dist_workers.comm_worker, 2, (2, 4), timeout_s=300)[0]


@pytest.mark.distributed
def test_megatron_sends_three_allreduces_per_block_oases_two(stats):
    payload = stats["allreduce_payload"]  # one (b, s, H) fp32 activation
    blocks = 2 * stats["layers"]  # attention + MLP per layer
    mega, oases = stats["megatron"], stats["oases"]
    # forward: one per block plus the vocab-parallel embedding; backward: one per
    # block plus the LM head's input gradient.
    for s in (mega, oases):
        assert s["forward"][0] == (blocks + 1) * payload
        assert s["backward"][0] == (blocks + 1) * payload
    assert mega["recompute"] == (blocks * payload, blocks)
    assert oases["recompute"] == (0, 0)
    per_block = {name: (sum(s[p][0] for p in ("forward", "recompute", "backward")) - 2 * payload) / (blocks * payload)
                 for name, s in (("megatron", mega), ("oases", oases))}
    assert per_block == {"megatron": 3.0, "oases": 2.0}


@pytest.mark.distributed
def test_split_overlap_recomputes_collectives_like_megatron(stats):
    assert stats["split_overlap"]["recompute"][0] == stats["megatron"]["recompute"][0]
    # the split schedule runs each collective once per sub-batch: twice the calls, same bytes
    assert stats["split_overlap"]["recompute"][1] == 2 * stats["megatron"]["recompute"][1]
