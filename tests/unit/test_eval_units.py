"""codi.evaluation.core.work_units: which units the evaluation runs, and in which order (no decoding here)."""

from __future__ import annotations

from codi.evaluation.core import WorkUnit, work_units
from tests.tiny import shipped


def test_one_process_keeps_the_modes_order_with_the_probe_after_latent():
    cfg = shipped("evaluate", processes=1)
    assert work_units(cfg) == [WorkUnit("decode", "explicit"), WorkUnit("decode", "latent"),
                               WorkUnit("probe", "latent"), WorkUnit("decode", "direct")]


def test_several_processes_take_the_longest_units_first():
    cfg = shipped("evaluate", processes=2)
    assert work_units(cfg) == [WorkUnit("decode", "latent"), WorkUnit("decode", "explicit"),
                               WorkUnit("probe", "latent"), WorkUnit("decode", "direct")]


def test_no_probe_without_its_examples_or_the_latent_mode():
    assert WorkUnit("probe", "latent") not in work_units(shipped("evaluate", probe_train_examples=0))
    assert work_units(shipped("evaluate", modes=["explicit", "direct"], processes=2)) == [
        WorkUnit("decode", "explicit"), WorkUnit("decode", "direct")]
