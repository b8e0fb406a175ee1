"""The spec list as data: which Hugging Face prefix and which layer file each pipeline spec has. Read by the stage
builder (models/llama_pipe.py), the layer files' loader and the converter alike, so the naming is defined once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec
from transformers import PretrainedConfig

from models.family_gemma4 import EMBED_PREFIX
from models.family_gemma4 import MODEL_TYPE as GEMMA4


def layer_file_name(spec_index: int) -> str:
    """Checkpoint file of one spec: DeepSpeed's ``PipelineModule.ckpt_layer_path`` naming.

    DeepSpeed writes ``layer_{index:02d}-model_states.pt`` for the pipe x data topology (it omits the
    data and pipe axes from the name). The model loader, the converter and the exporter all use this
    function, so the name is defined once.
    """
    return f"layer_{spec_index:02d}-model_states.pt"


@dataclass(frozen=True)
class SpecInfo:
    """Where one pipeline spec's weights live, in both layouts."""

    index: int  # position in the spec list = DeepSpeed layer index
    kind: str  # "embed" | "decoder" | "norm" | "head"
    hf_prefix: str  # Hugging Face state-dict prefix of this module's parameters
    file_index: int  # spec whose layer file holds the weights (differs only for a tied LM head)

    @property
    def owns_file(self) -> bool:
        """True when this spec's weights are stored in its own layer file."""
        return self.file_index == self.index


def spec_layout(config: PretrainedConfig) -> list[SpecInfo]:
    """The spec list as data: index, kind, Hugging Face prefix and layer file of every spec."""
    n = config.num_hidden_layers
    tied = bool(config.tie_word_embeddings)
    # Gemma 4's spec 0 holds model.embed_tokens and its per-layer inputs' modules (models/family_gemma4.py)
    embed = EMBED_PREFIX if config.model_type == GEMMA4 else "model.embed_tokens."
    layout = [SpecInfo(0, "embed", embed, 0)]
    layout += [SpecInfo(1 + i, "decoder", f"model.layers.{i}.", 1 + i) for i in range(n)]
    layout.append(SpecInfo(n + 1, "norm", "model.norm.", n + 1))
    # A tied head has no weights of its own: DeepSpeed saves the shared module once, with the
    # embedding (spec 0), and broadcasts it to the last stage.
    layout.append(SpecInfo(n + 2, "head", embed if tied else "lm_head.", 0 if tied else n + 2))
    return layout


def expected_state_shapes(spec: LayerSpec, parameters_only: bool = False) -> dict[str, torch.Size]:
    """State-dict keys and shapes of one spec's module, built on the meta device (no memory, no init);
    ``parameters_only``: without its persistent buffers (DeepSeek-V3's router bias), as parameter counts count."""
    with torch.device("meta"):
        module = spec.build()
    tensors = dict(module.named_parameters()) if parameters_only else module.state_dict()
    return {key: tensor.shape for key, tensor in tensors.items()}
