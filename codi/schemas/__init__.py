"""The params.yaml schemas, one module per section, so that a stage depends only on what it reads.

    extract.py     extract (synthetic, paths, trace, sandbox, dask)     precompute.py  precompute
    model.py       model (tiny)                                          train.py       sft, sft_direct
    codi.py        codi (its CODI options: codi/schemas/options.py)    evaluate.py    evaluate
    wandb.py       wandb                                                 pipeline.py    pipeline

codi/schemas/params.py puts them together (the whole file); codi/infra/config.py is the machinery (option, build, load).
Nothing is imported here: importing one section must not import the others.
"""
