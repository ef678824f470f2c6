"""posttrain core: model, parallelism, LoRA, losses, data and the training primitives."""
