"""Research tools on top of the pipeline: each runs or reads `dvc exp` experiments, none is a DVC stage.

    dvc_exp     the one place that formats `-S` values, builds and runs `dvc exp run`, and reads an
                experiment's files at its git ref (pipelines/ uses it too)
    ladder      the task ladder: one experiment per rung (python -m experiments.ladder)
    profile     named presets for a kind of machine (python -m experiments.profile)
    fresh_seed  the committed models on a fresh draw of the task (python -m experiments.fresh_seed)
"""
