"""The data between the stages, one concern a module (import the module you need):

    traces       the traces parquet (extract's output)
    spans        tokenize prompt + trace and locate every LINE frame's locals span
    answers      the return VALUE: reading it back, comparing it, the direct (no-trace) format
    cache_build  traces -> tokenized, split rows (precompute)
    cache        the Arrow cache: split assignment, writing, memory-mapped CacheDataset
    batching     CausalLMCollator for sft and sft_direct
    values       the value each LINE frame carries: the targets of the value levers and the probe
"""
