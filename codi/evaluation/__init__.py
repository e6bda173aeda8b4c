"""Evaluation, one concern a module (import the module you need):

    decoding  greedy batched decoding in the explicit, latent and direct modes
    metrics   per-example scores and their means per mode and source
    probe     what the latent blocks carry: logit lens, linear probe, constant-latent ablation
    report    the reports: eval.json, eval.md, predictions, plots
"""
