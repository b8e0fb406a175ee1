"""The module names LoRA may target, by their Hugging Face names (every supported family). Free of
imports, so the config schema (training/configuration/schema.py) can take its defaults from here."""

# The linear layers of a decoder layer.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules outside the decoder layers that peft.modules_to_save may train fully, with their spec kind.
SAVABLE_MODULES = {"embed_tokens": "embed", "lm_head": "head"}
