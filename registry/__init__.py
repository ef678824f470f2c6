"""Model import/export (HF checkpoints, tokenizers, PEFT adapters) and the MLflow model registry."""
