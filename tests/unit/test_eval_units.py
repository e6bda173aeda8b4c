"""codi.evaluation.core's units: which run, in which order, and how the ablation splits (no decoding here)."""

from __future__ import annotations

import random

from codi.evaluation.core import WorkUnit, ablation_units, balanced_bounds, work_units
from tests.tiny import shipped


def test_explicit_and_latent_decode_together_first_then_the_latent_units_then_direct():
    assert work_units(shipped("evaluate", processes=1)) == [WorkUnit("decode", ("explicit", "latent")),
                                                            WorkUnit("forced"), WorkUnit("probe"),
                                                            WorkUnit("decode", ("direct",))]
    assert work_units(shipped("evaluate", processes=2)) == work_units(shipped("evaluate", processes=1))


def test_no_probe_without_its_examples_and_no_latent_unit_without_the_latent_mode():
    assert WorkUnit("probe") not in work_units(shipped("evaluate", probe_train_examples=0))
    assert work_units(shipped("evaluate", modes=["explicit", "direct"], processes=2)) == [
        WorkUnit("decode", ("explicit",)), WorkUnit("decode", ("direct",))]
    assert work_units(shipped("evaluate", modes=["direct"])) == [WorkUnit("decode", ("direct",))]
    assert ablation_units(shipped("evaluate", modes=["explicit", "direct"]), [5] * 100) == []
    assert ablation_units(shipped("evaluate", ablate_latents=False), [5] * 100) == []


def test_the_ablation_splits_into_whole_batches_balanced_by_cost():
    cfg = shipped("evaluate", processes=2, batch_size=32)
    even = ablation_units(cfg, [10] * 905)
    assert [(u.start, u.stop) for u in even] == [(0, 448), (448, 905)]  # 14 and 15 batches of equal cost
    # the last 265 examples cost three times as much: the cut moves from batch 14 to 21, so the parts cost alike
    skewed = ablation_units(cfg, [10] * 640 + [30] * 265)
    assert [(u.start, u.stop) for u in skewed] == [(0, 672), (672, 905)]  # 7360 and 6990 of 14350
    assert ablation_units(shipped("evaluate", processes=1, batch_size=32), [10] * 905) == [
        WorkUnit("constant", ("latent",), 0, 905)]
    assert len(ablation_units(shipped("evaluate", processes=4, batch_size=32), [1] * 40)) == 2  # 2 batches
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        parts = rng.randint(1, 6)
        bounds = balanced_bounds(costs, parts)
        assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) - 1 <= parts
        assert all(a < b for a, b in zip(bounds, bounds[1:]))  # every part non-empty, in order
        assert len(bounds) - 1 == min(parts, len(costs))
