"""The cost table's typed identity and profile (family, schedule, per-op times) and the files of older layouts.

Why: a plan's replayed step is priced from the table's per-op profile, so it is a typed field, not
string keys in the evidence; tables written before (cost models 6-9, the stored profiles of the
cost-model study) must load into the same fields with the same numbers, or be refused in one line.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from oases_ds.planner.costs import TABLE_FORMAT, CostTable, DegreeProfile, OpTimes, PassTimes
from oases_ds.schedule.generators import ScheduleSpec
from support import random_table

PROFILES = Path(__file__).resolve().parents[1] / "fixtures" / "profiles"


@pytest.mark.parametrize("name", ["gpt_t2_cm6.json", "gpt_t2_cm8.json", "gpt_t2_cm9.json", "gpt_t4_cm9.json"])
def test_an_older_table_file_loads_into_the_typed_fields(name):
    """Each degree's ``op_ms_rank0`` ("<op>:F|R|B" -> ms), ``allreduce_bytes`` and block times leave the
    evidence for :attr:`CostTable.op_profile` unchanged in value; the family comes from the model label."""
    raw = json.loads((PROFILES / name).read_text())
    table = CostTable.from_json(PROFILES / name)
    assert "table_format" not in raw and table.family == "gpt" and table.schedule == ScheduleSpec("oases")
    assert sorted(table.op_profile) == list(table.degrees)
    for degree in table.degrees:
        old, new = raw["measurements"]["degrees"][str(degree)], table.op_profile[degree]
        assert new.payload_bytes == old["allreduce_bytes"]
        for key, ms in old["op_ms_rank0"].items():
            op, letter = key.split(":")
            assert new.op_ms.of_pass(letter)[int(op)] == ms
        assert sum(len(new.op_ms.of_pass(letter)) for letter in "FRB") == len(old["op_ms_rank0"])
        for kind, timing in old["blocks"].items():
            assert new.block_ms[kind] == PassTimes(timing["fwd_ms"], timing["recompute_ms"], timing["bwd_ms"])
        kept = table.measurements["degrees"][str(degree)]
        assert "op_ms_rank0" not in kept and "allreduce_bytes" not in kept and kept["blocks"] == old["blocks"]
    assert table.key().rsplit("|cm", 1)[0] == "|".join((raw["model"], raw["cluster"], raw["schedule"], str(raw["devices"])))


def test_a_table_round_trips_in_the_current_layout(tmp_path):
    table = CostTable.from_json(PROFILES / "gpt_t4_cm9.json")
    path = tmp_path / "t.json"
    table.to_json(path)
    written = json.loads(path.read_text())
    assert written["table_format"] == TABLE_FORMAT and written["family"] == "gpt"
    assert written["schedule"] == {"name": "oases", "sub_batches": 2, "cross_pass": True, "fine_grained_recompute": True}
    assert CostTable.from_json(path) == table


def test_non_default_schedule_settings_survive_both_layouts(tmp_path):
    """A label such as ``oases[sb=4,cross=0,fine=1]`` (the older layout's only record of the settings)
    reads back as those settings; the current layout writes the settings themselves."""
    spec = ScheduleSpec("oases", sub_batches=4, cross_pass=False)
    table = dataclasses.replace(random_table(2, layers=2), schedule=spec)
    path = tmp_path / "t.json"
    table.to_json(path)
    assert CostTable.from_json(path).schedule == spec
    data = json.loads(path.read_text())
    del data["table_format"], data["family"], data["op_profile"]
    data["schedule"] = spec.label
    path.write_text(json.dumps(data))
    assert spec.label == "oases[sb=4,cross=0,fine=1]" and CostTable.from_json(path).schedule == spec
    assert CostTable.from_json(path).family is None  # "random-2" names no model family: priced additively


def test_a_layout_this_code_does_not_read_is_one_line(tmp_path):
    path = tmp_path / "t.json"
    random_table(1, layers=2).to_json(path)
    data = json.loads(path.read_text())
    data["table_format"] = TABLE_FORMAT + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{path}: table_format {TABLE_FORMAT + 1} is not one this code reads "
                                         rf"\({TABLE_FORMAT}\); profile again$"):
        CostTable.from_json(path)


def test_typed_fields_refuse_what_the_replay_cannot_use():
    table = random_table(3, layers=2)
    with pytest.raises(TypeError, match=r"CostTable.schedule must be a ScheduleSpec, e.g. ScheduleSpec\('oases'\)"):
        dataclasses.replace(table, schedule="oases")
    with pytest.raises(ValueError, match="CostTable.family='gpt2' unknown"):
        dataclasses.replace(table, family="gpt2")
    with pytest.raises(ValueError, match="CostTable.op_profile has degree 8"):
        dataclasses.replace(table, op_profile={8: DegreeProfile(OpTimes(), 0)})
    with pytest.raises(ValueError, match=r"OpTimes.forward_ms\[0\] must be a finite number >= 0"):
        OpTimes(forward_ms={0: -1.0})
    with pytest.raises(ValueError, match="per-op time '3:X' is not '<op index>:F|R|B'"):
        OpTimes.from_keys({"3:X": 1.0})
