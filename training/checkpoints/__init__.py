"""Checkpoints a run resumes from exactly (``save_restore``), written in the background (``async_save``), and
optimizer states read on another layout (``reshard``)."""
