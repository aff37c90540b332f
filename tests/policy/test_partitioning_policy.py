"""policy.partitioning: Eq 4.14 plan choice on a real plan table, and scale-down order."""

from __future__ import annotations

import pytest

from flashpoint.partition.model import CostModel, LayerProfile
from flashpoint.partition.solver import best_plan
from flashpoint.partition.table import plan_table
from flashpoint.policy.partitioning import (
    GroupSnapshot,
    ScaleUpLoad,
    choose_plan,
    expected_load,
    scale_down_order,
    scale_down_select,
)

PROFILES = [LayerProfile(f"layers.{i}", 200_000_000, 0.004, 2_000_000) for i in range(8)]
COST = CostModel(bandwidth_bps=2e9, link_bps=10e9, overhead_s=0.5)


def test_expected_load_is_eq_4_14_floored_at_one():
    assert expected_load(ScaleUpLoad(10, 50.0, 20.0, 2.0)) == 70.0
    assert expected_load(ScaleUpLoad(0, 5.0, 20.0, 2.0)) == 1.0  # replicas keep up
    assert expected_load(ScaleUpLoad(3, 5.0, 5.0, 9.0)) == 3.0


def test_choose_plan_is_the_tables_best_for_the_expected_load():
    table = plan_table(PROFILES, COST, p_max=8, x_max=200)
    for load, gpus in ((ScaleUpLoad(0, 1.0, 1.0, 1.0), 4), (ScaleUpLoad(50, 80.0, 10.0, 1.0), 4),
                       (ScaleUpLoad(2, 0.0, 0.0, 0.0), 1)):
        plan = choose_plan(table, load, gpus)
        x = expected_load(load)
        want = best_plan(PROFILES, COST, gpus, int(x), gpus)
        assert plan.p <= gpus
        assert plan.tbar_s == pytest.approx(want.tbar_s)


def test_transfer_dominated_model_with_light_load_is_split():
    # Moving 1.6 GB at 2 Gbit/s dominates; with one request waiting, more stages start sooner.
    table = plan_table(PROFILES, COST, p_max=8, x_max=50)
    assert choose_plan(table, ScaleUpLoad(1, 0.0, 0.0, 7.0), 4).p > 1
    with pytest.raises(ValueError):
        choose_plan(table, ScaleUpLoad(1, 0.0, 0.0, 7.0), 0)


def test_scale_down_retires_pipelines_before_whole_replicas():
    groups = [GroupSnapshot("whole-old", 1, 10.0), GroupSnapshot("pipe2", 2, 30.0),
              GroupSnapshot("whole-new", 1, 20.0), GroupSnapshot("pipe4", 4, 5.0)]
    assert scale_down_order(groups) == ["pipe4", "pipe2", "whole-new", "whole-old"]


def test_scale_down_selects_only_groups_that_fit_in_the_gpus_to_free():
    groups = [GroupSnapshot("whole-old", 1, 10.0), GroupSnapshot("pipe2", 2, 30.0),
              GroupSnapshot("whole-new", 1, 20.0), GroupSnapshot("pipe4", 4, 5.0)]
    assert scale_down_select(groups, 1) == ["whole-new"]  # no pipeline for one GPU
    assert scale_down_select(groups, 3) == ["pipe2", "whole-new"]  # 4 > 3: pipe4 stays
    assert scale_down_select(groups, 5) == ["pipe4", "whole-new"]  # then 2 > 1: pipe2 stays
    assert scale_down_select(groups, 8) == ["pipe4", "pipe2", "whole-new", "whole-old"]
    assert scale_down_select(groups, 0) == []
    assert scale_down_select([GroupSnapshot("pipe3", 3, 0.0)], 2) == []  # at most n GPUs
