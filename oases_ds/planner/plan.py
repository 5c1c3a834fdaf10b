"""The planner's output: a TMP degree for every attention and MLP block.

A plan is the hand-off between the solver and the runtime that builds the
model, so it is saved as JSON, validated on load, and carries where it came
from (cost-table key, solver, its predicted step time) for the benchmark reports.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

from oases_ds.planner.costs import check_degree
from oases_ds.planner.jsonio import load_dataclass
from oases_ds.schedule.costed_merge import HopCosts
from oases_ds.schedule.generators import RECOMPUTE_POLICIES
from oases_ds.utils.io import read_json_input, write_json_atomic


class PlanInfeasibleError(ValueError):
    """No assignment of degrees fits the memory limit."""


@dataclass(frozen=True)
class Plan:
    """Per-layer TMP degrees for a TMP group of ``devices`` devices, and optionally each
    block's recomputation policy (:data:`~oases_ds.schedule.generators.RECOMPUTE_POLICIES`).

    Degree and policy lists are stored as tuples so the frozen plan really is immutable.
    """

    attn_degrees: tuple[int, ...]
    mlp_degrees: tuple[int, ...]
    devices: int
    predicted_step_ms: float | None = None
    """Objective value of the plan under its cost table; None for a hand-made plan."""
    solver_ms: float = 0.0
    solver_name: str = "manual"
    memory_bytes: float | None = None
    """Per-device state + activation bytes under the cost table."""
    table_key: str | None = None
    """:meth:`CostTable.key` of the profile the plan was solved against."""
    stage_layers: tuple[int, ...] | None = None
    """Pipeline stages (:mod:`oases_ds.planner.stages`): layers of each stage in order,
    summing to :attr:`layers`; the degrees above run through every stage.  None: one stage
    (every plan written before stages)."""
    stage_step_ms: tuple[float, ...] | None = None
    """Each stage's predicted time per micro-batch; ``predicted_step_ms`` is then the 1F1B step."""
    stage_memory_bytes: tuple[float, ...] | None = None
    """Each stage's per-device memory bound with its 1F1B micro-batches in flight;
    ``memory_bytes`` is then their largest."""
    micro_batches: int | None = None
    """Micro-batches per step the stage split was planned for."""
    attn_policies: tuple[str, ...] | None = None
    """Per layer, the attention block's recomputation policy: ``oases`` (fine-grained recompute)
    or ``store`` (activations kept, no recompute).  None: every block ``oases`` (every plan
    written before policies).  Given, ``mlp_policies`` must be too."""
    mlp_policies: tuple[str, ...] | None = None
    """Per layer, the MLP block's policy, as :attr:`attn_policies`."""
    sub_batches: int | None = None
    """The sub-batches the plan was chosen for among several (``oases-plan planner.sub_batches=[2,4]``,
    :func:`~oases_ds.planner.planning.choose_sub_batches`); the run takes them.  None: the schedule's own."""
    hop_costs: HopCosts | None = None
    """Under sequence parallelism, the per-op times the plan was priced with: its run orders the
    sub-batches' hops by them, as the replay that priced it did (:mod:`oases_ds.schedule.costed_merge`).
    None: the time-blind order (no sequence parallelism, a hand-made plan, every plan written before)."""

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"Plan.devices must be >= 1, got {self.devices}")
        object.__setattr__(self, "attn_degrees", tuple(self.attn_degrees))
        object.__setattr__(self, "mlp_degrees", tuple(self.mlp_degrees))
        self._check_stages()
        if len(self.attn_degrees) != len(self.mlp_degrees) or not self.attn_degrees:
            raise ValueError(
                f"Plan.attn_degrees and Plan.mlp_degrees must be non-empty and equally long, "
                f"got {len(self.attn_degrees)} and {len(self.mlp_degrees)}"
            )
        for name in ("attn_degrees", "mlp_degrees"):
            for layer, degree in enumerate(getattr(self, name)):
                check_degree(f"Plan.{name}[{layer}]", degree, self.devices)
        self._check_policies()
        if self.hop_costs is not None:
            try:
                object.__setattr__(self, "hop_costs", HopCosts.from_value(self.hop_costs))
            except ValueError as err:
                raise ValueError(f"Plan.{err}") from None
        if self.sub_batches is not None and (isinstance(self.sub_batches, bool) or not isinstance(self.sub_batches, int)
                                             or self.sub_batches < 1):
            raise ValueError(f"Plan.sub_batches must be an int >= 1, got {self.sub_batches!r}")

    def _check_policies(self) -> None:
        """Both policy lists or neither, one known policy per layer."""
        if (self.attn_policies is None) != (self.mlp_policies is None):
            raise ValueError("Plan.attn_policies and Plan.mlp_policies come together; give both or neither")
        if self.attn_policies is None:
            return
        for name in ("attn_policies", "mlp_policies"):
            value = getattr(self, name)
            if isinstance(value, str) or len(value) != self.layers:
                raise ValueError(f"Plan.{name} must list one policy per layer ({self.layers}), got {value!r}")
            object.__setattr__(self, name, tuple(value))
            for layer, policy in enumerate(value):
                if policy not in RECOMPUTE_POLICIES:
                    raise ValueError(f"Plan.{name}[{layer}]={policy!r} unknown; choose one of "
                                     f"{', '.join(RECOMPUTE_POLICIES)}")

    def _check_stages(self) -> None:
        """Stage fields are all set or all unset, one entry per stage, layers summing to the plan's."""
        names = ("stage_layers", "stage_step_ms", "stage_memory_bytes")
        for name in names:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.stage_layers is None:
            if any(getattr(self, name) is not None for name in names[1:]) or self.micro_batches is not None:
                raise ValueError("Plan.stage_step_ms, stage_memory_bytes and micro_batches describe stages; "
                                 "give Plan.stage_layers too, or none of them")
            return
        if not self.stage_layers or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.stage_layers):
            raise ValueError(f"Plan.stage_layers must be layer counts >= 1, got {list(self.stage_layers)}")
        if sum(self.stage_layers) != len(self.attn_degrees):
            raise ValueError(f"Plan.stage_layers {list(self.stage_layers)} sum to {sum(self.stage_layers)}; "
                             f"the plan has {len(self.attn_degrees)} layers")
        for name in names[1:]:
            value = getattr(self, name)
            if value is not None and len(value) != len(self.stage_layers):
                raise ValueError(f"Plan.{name} has {len(value)} entries for {len(self.stage_layers)} stages")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise ValueError(f"Plan.micro_batches must be an int >= 1, got {self.micro_batches!r}")

    @property
    def stages(self) -> int:
        """Pipeline stages the plan was made for (1: no pipeline)."""
        return 1 if self.stage_layers is None else len(self.stage_layers)

    @property
    def layers(self) -> int:
        return len(self.attn_degrees)

    def block_degrees(self) -> list[int]:
        """Degrees in execution order attn0, mlp0, attn1, ... (the solver's block index)."""
        return [degree for pair in zip(self.attn_degrees, self.mlp_degrees) for degree in pair]

    def block_policies(self) -> list[str]:
        """Policies in execution order attn0, mlp0, ...; ``oases`` everywhere when the plan has none."""
        if self.attn_policies is None or self.mlp_policies is None:
            return ["oases"] * (2 * self.layers)
        return [policy for pair in zip(self.attn_policies, self.mlp_policies) for policy in pair]

    def stored_blocks(self) -> tuple[int, ...]:
        """Block indices whose policy is ``store``: what the schedule keeps instead of recomputing
        (:attr:`ScheduleSpec.stored_blocks <oases_ds.schedule.generators.ScheduleSpec.stored_blocks>`)."""
        return tuple(block for block, policy in enumerate(self.block_policies()) if policy == "store")

    def gathered_blocks(self) -> tuple[int, ...]:
        """Block indices whose policy is ``oases_gathered``: under sequence parallelism their
        recomputation keeps the gathered input instead of re-gathering it
        (:attr:`ScheduleSpec.gathered_blocks <oases_ds.schedule.generators.ScheduleSpec.gathered_blocks>`)."""
        return tuple(block for block, policy in enumerate(self.block_policies()) if policy == "oases_gathered")

    @classmethod
    def from_block_degrees(cls, block_degrees: Sequence[int], devices: int,
                           block_policies: Sequence[str] | None = None, **provenance: object) -> Plan:
        """Inverse of :meth:`block_degrees` (and :meth:`block_policies`, when given and not all
        ``oases``); ``provenance`` fills the optional fields."""
        policies: dict[str, object] = {}
        if block_policies is not None and any(policy != "oases" for policy in block_policies):
            policies = {"attn_policies": tuple(block_policies[0::2]), "mlp_policies": tuple(block_policies[1::2])}
        return cls(
            attn_degrees=tuple(block_degrees[0::2]),
            mlp_degrees=tuple(block_degrees[1::2]),
            devices=devices,
            **policies,  # type: ignore[arg-type]
            **provenance,  # type: ignore[arg-type]
        )

    @classmethod
    def uniform(cls, devices: int, layers: int, degree: int) -> Plan:
        """Megatron's plan: the same degree everywhere, the baseline the planner must beat."""
        return cls((degree,) * layers, (degree,) * layers, devices, solver_name="uniform")

    def as_table(self) -> str:
        """Text form in the shape of the paper's Table II, runs of equal layers collapsed; with
        policies, each block's after its degree (``attn 2 store, mlp 4 oases``)."""
        policies = self.block_policies()
        with_policies = self.attn_policies is not None

        def row(layer: int) -> tuple:
            return (self.attn_degrees[layer], self.mlp_degrees[layer], policies[2 * layer], policies[2 * layer + 1])

        rows: list[str] = []
        start = 0
        for layer in range(1, self.layers + 1):
            attn, mlp, attn_policy, mlp_policy = row(start)
            if layer == self.layers or row(layer) != row(start):
                span = f"{start}" if layer - 1 == start else f"{start}-{layer - 1}"
                if with_policies:
                    rows.append(f"layers {span}: attn {attn} {attn_policy}, mlp {mlp} {mlp_policy}")
                else:
                    rows.append(f"layers {span}: attn {attn}, mlp {mlp}")
                start = layer
        return "\n".join(rows)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Plan:
        return load_dataclass(path, cls)

    @classmethod
    def read(cls, key: str, path: str) -> Plan:
        """The plan file a user named with the setting ``key`` (``plan``, ``oases.plan``); a file
        that cannot be read or parsed is a ``ValueError`` of one line naming the setting
        (:func:`~oases_ds.utils.io.read_json_input`)."""
        return read_json_input(key, path, cls.from_json, "give the JSON file oases-plan wrote")
