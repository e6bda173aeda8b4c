"""What the training stages share, one concern a module (import the module you need):

    args         TrainingArguments from a params section (nothing a user would tune is hard-coded)
    checkpoints  resumable checkpoints of one run, identified by its fingerprint (params, data, model, code)
    tracking     wandb (offline by default) and dvclive (live DVC metrics and plots)
    grouped      the HF Trainer with length-grouped batches (sft, sft_direct)
    codi_trainer CodiTrainer (codi)
    loop         the shared set-up of a training stage: train, then save the final model atomically
    summary      the end-of-stage metrics and the loss-curve PNG
"""
