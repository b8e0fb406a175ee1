"""Hugging Face's own modules as DeepSpeed pipeline stages, knowing nothing of ranks: the families, the stage
contract and spec layout, the losses, LoRA, and (``files/``) the model's files in and out. The lowest layer: it
imports no other package of the project."""
