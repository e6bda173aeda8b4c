"""codi.evaluation.core's units: which run, in which order, and how the ablation splits (no decoding here)."""

from __future__ import annotations

from codi.evaluation.core import WorkUnit, ablation_units, part_slice, work_units
from tests.tiny import shipped


def test_the_timed_unit_decodes_every_mode_first_then_the_latent_units():
    assert work_units(shipped("evaluate", processes=1)) == [WorkUnit("decode", ("explicit", "latent", "direct")),
                                                            WorkUnit("forced"), WorkUnit("probe")]
    assert work_units(shipped("evaluate", processes=2)) == work_units(shipped("evaluate", processes=1))


def test_no_probe_without_its_examples_and_no_latent_unit_without_the_latent_mode():
    assert WorkUnit("probe") not in work_units(shipped("evaluate", probe_train_examples=0))
    assert work_units(shipped("evaluate", modes=["explicit", "direct"], processes=2)) == [
        WorkUnit("decode", ("explicit", "direct"))]
    assert ablation_units(shipped("evaluate", modes=["explicit", "direct"]), 100) == []
    assert ablation_units(shipped("evaluate", ablate_latents=False), 100) == []


def test_the_ablation_splits_into_whole_batches_one_part_per_process():
    cfg = shipped("evaluate", processes=2, batch_size=32)
    assert ablation_units(cfg, 905) == [WorkUnit("constant", ("latent",), 0, 2), WorkUnit("constant", ("latent",), 1, 2)]
    assert ablation_units(shipped("evaluate", processes=4, batch_size=32), 40) == [
        WorkUnit("constant", ("latent",), k, 2) for k in range(2)]  # no more parts than batches
    for n, parts, bs in ((905, 2, 32), (905, 3, 32), (40, 2, 32), (7, 1, 4)):
        slices = [part_slice(k, parts, n, bs) for k in range(parts)]
        covered = [i for s in slices for i in range(n)[s]]
        assert covered == list(range(n))  # in order, every example once
        assert all(s.start % bs == 0 for s in slices)  # each part starts on a batch boundary
