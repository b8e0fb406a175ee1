"""Model files in and out: Hugging Face checkpoints <-> per-layer pipeline files (``hf_convert``), a pipeline
checkpoint directory read one stage at a time (``pipeline_dir``), a stage read straight from a Hugging Face directory
(``hf_stage``), MoE tensors as Hugging Face stores them (``hf_experts``), PEFT adapters (``peft_adapter``), ZeRO-3
partitioned loading (``zero3_load``), and why a Hugging Face directory cannot be loaded (``hf_dir_checks``)."""
