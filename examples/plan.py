"""Plan per-block TMP degrees from Python: what ``oases-plan`` runs, without the CLI.

Profiles one layer of the model at every TMP degree on 2 local rank processes (cached under
``.oases/profiles``), solves for a degree per attention and MLP block under a 2 GiB-per-device
memory limit, re-ranks the solver's plan against the uniform ones by replaying their schedules,
and writes the winner for ``oases-train plan=plan.json``.

    python examples/plan.py [plan.json]
"""
import sys

from oases_ds import ModelConfig
from oases_ds.planner import PlanRequest, make_plan
from oases_ds.planner.profile import ProfileSpec

if __name__ == "__main__":  # the profiler's rank processes start by importing this file (spawn)
    model = ModelConfig(family="gpt", vocab_size=256, hidden_size=128, num_heads=4, num_layers=4, seq_len=64)
    result = make_plan(PlanRequest(ProfileSpec(model=model, devices=2, micro_batch=8), memory_limit_bytes=2 * 2**30))
    print(result.plan.attn_degrees, result.plan.mlp_degrees, result.plan.predicted_step_ms)
    result.plan.to_json(sys.argv[1] if len(sys.argv) > 1 else "plan.json")  # oases-train plan=plan.json
