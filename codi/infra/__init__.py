"""Infrastructure every stage shares, one concern a module (import the module you need):

    config      how params.yaml is read: option(), build(), read_yaml, load_params, ConfigError
    files       atomic writes and file digests
    provenance  a stage's static import closure inside codi/ and its code digest
    device      precision, optimizer and thread policy: the `auto` settings resolved for this machine
    launch      data-parallel CPU training without a launcher (gloo workers started by the stage)
    linux       prctl through ctypes
    hf          load_causal_lm: a model folder, or one error line
"""
