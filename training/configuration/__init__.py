"""The typed training config (``schema``) and every rule checked before any process group starts (``validate``
collects them: the layout's, each axis's, the data's, the DeepSpeed JSON's, output_dir's, the resume's)."""
