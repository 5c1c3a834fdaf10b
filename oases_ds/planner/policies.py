"""What a block costs under recomputation policy ``store``, derived from the table of policy ``oases``.

Why derived and not profiled again: a stored block runs the same forward and backward ops as a
recomputed one, minus its Recompute pass, so every number the planner needs is already in an
``oases`` table -- the recompute time of each block (``op_profile[t].block_ms[kind]``), its raw
collective time (``measurements.degrees[t].blocks[kind]``) -- except the memory it holds, which
the memory model replays with the block stored (the model the memory tests hold to <= 10% of the
measured peak, stored blocks included).  What changes for a stored block:

* ``bwd_ms`` loses the recompute;
* its exposed communication is priced by the schedule's closed form without the recompute: in
  the cross-pass schedule a backward collective of one sub-batch hides behind the other
  sub-batch's recompute *and* backward, a stored block's only behind its backward.  A table whose
  exposed comm was measured (``planner.exposed=measured``) keeps its measurement plus the
  modelled difference;
* ``act_bytes`` is the block's kept graph instead of its one checkpoint.

The table's constant (``fixed_bytes``, per stage role too) becomes the larger of the two
policies' constants, so ``states + rows + constant`` still bounds a plan mixing them.
"""
from __future__ import annotations

import dataclasses

from oases_ds.models.config import ModelConfig
from oases_ds.planner.costmodel import pipelined_comm_ms
from oases_ds.planner.costs import BLOCK_KINDS, BlockCost, CostTable
from oases_ds.planner.memory import PROBE_LAYERS, memory_rows
from oases_ds.schedule.closed_forms import BlockTiming

RECOMPUTE_CHOICES: tuple[str, ...] = ("oases", "auto")
"""``planner.recompute``: ``oases`` recomputes every block (the paper's schedule, every plan before
policies); ``auto`` lets the solver choose ``store`` or ``oases`` per block with its degree."""


def stored_block_cost(cost: BlockCost, timing: BlockTiming, table: CostTable, act_bytes: float) -> BlockCost:
    """``cost`` (a block under ``oases``, its pass times ``timing``) under policy ``store``."""
    return policy_cost(cost, timing, dataclasses.replace(timing, recompute_ms=0.0), table, act_bytes)


def policy_cost(cost: BlockCost, timing: BlockTiming, kept: BlockTiming, table: CostTable, act_bytes: float) -> BlockCost:
    """``cost`` (a block under ``oases``, its pass times ``timing``) under another policy whose pass
    times are ``kept`` (less recompute, or a collective fewer): backward loses the recompute it no
    longer runs, and the exposed communication moves by what the schedule's closed form says of the
    change (a table whose exposed comm was measured keeps its measurement plus that difference)."""
    before = pipelined_comm_ms(timing, table.schedule)
    now = pipelined_comm_ms(kept, table.schedule)
    had = (cost.comm_fwd_ms, cost.comm_bwd_ms, cost.comm_fwd_last_ms, cost.comm_bwd_last_ms)
    exposed = [max(0.0, was + new - old) for was, new, old in zip(had, now, before)]
    return dataclasses.replace(cost, bwd_ms=max(0.0, cost.bwd_ms - (timing.recompute_ms - kept.recompute_ms)),
                               comm_fwd_ms=exposed[0], comm_bwd_ms=exposed[1], comm_fwd_last_ms=exposed[2],
                               comm_bwd_last_ms=exposed[3], act_bytes=act_bytes)


def _timing(table: CostTable, kind: str, degree: int) -> BlockTiming:
    """The block's pass and raw collective times, as the profiler / analytic model recorded them."""
    try:
        evidence = table.measurements["degrees"][str(degree)]["blocks"][kind]
        return BlockTiming(**{f.name: float(evidence[f.name]) for f in dataclasses.fields(BlockTiming)})
    except (KeyError, TypeError) as err:
        raise ValueError(f"planner.recompute=auto: table {table.key()} does not record the {kind} block's pass times "
                         f"at degree {degree} (measurements.degrees.{degree}.blocks.{kind}: missing {err}); profile "
                         f"again (drop table=) or plan with planner.recompute=oases") from None


def _regather_ms(table: CostTable, kind: str, degree: int) -> float:
    """The re-gather a sequence-parallel ``oases`` block runs in its recomputation (in its
    ``comm_bwd_ms``), as the profiler / analytic model recorded it; 0 without sequence parallelism."""
    return float(table.measurements["degrees"][str(degree)]["blocks"][kind].get("regather_ms", 0.0))


def with_store_costs(table: CostTable, cfg: ModelConfig, micro_batch: int, dtype_bytes: int) -> CostTable:
    """``table`` with :attr:`~oases_ds.planner.costs.CostTable.store_blocks` filled (module doc), for
    the model ``cfg`` at ``micro_batch`` samples whose activations are ``dtype_bytes`` per element;
    under sequence parallelism also :attr:`~oases_ds.planner.costs.CostTable.gathered_blocks`
    (policy ``oases_gathered``: the recompute as ``oases``, without its re-gather, the gathered input
    held).  Neither a stored nor a gathered block re-gathers.

    A schedule that cannot store blocks is one line naming the fix."""
    schedule = table.schedule
    if not (schedule.name == "oases" and schedule.fine_grained_recompute):
        raise ValueError(f"planner.recompute=auto chooses between policies store and oases, which only schedule=oases "
                         f"with fine_grained_recompute=true runs; this table is {schedule.label}: use schedule=oases "
                         f"or planner.recompute=oases")
    every_block = tuple(range(2 * PROBE_LAYERS))
    sp = table.sequence_parallel
    policies = {"store": "stored_blocks", **({"oases_gathered": "gathered_blocks"} if sp else {})}
    priced: dict[str, dict[str, dict[int, BlockCost]]] = {}
    fixed, stage_fixed = table.fixed_bytes, dict(table.stage_fixed_bytes)
    evidence = {}
    for policy, key in policies.items():
        rows = memory_rows(cfg, dataclasses.replace(schedule, **{key: every_block}), table.devices, micro_batch,
                           table.degrees, dtype_bytes, sp)
        priced[policy] = {}
        for kind in BLOCK_KINDS:
            priced[policy][kind] = {}
            for degree in table.degrees:
                timing = _timing(table, kind, degree)
                kept = dataclasses.replace(timing, comm_bwd_ms=timing.comm_bwd_ms - _regather_ms(table, kind, degree))
                if policy == "store":
                    kept = dataclasses.replace(kept, recompute_ms=0.0)
                priced[policy][kind][degree] = policy_cost(table.blocks[kind][degree], timing, kept, table,
                                                           rows.act_bytes[kind][degree])
        fixed = max(fixed, rows.fixed_bytes)
        stage_fixed = {role: max(value, rows.stage_fixed_bytes.get(role, value)) for role, value in stage_fixed.items()}
        evidence[policy] = rows.evidence
    measurements = {**table.measurements, "store_memory": evidence["store"],
                    **({"gathered_memory": evidence["oases_gathered"]} if sp else {})}
    return dataclasses.replace(table, store_blocks=priced["store"], gathered_blocks=priced.get("oases_gathered", {}),
                               fixed_bytes=fixed, stage_fixed_bytes=stage_fixed, measurements=measurements)
