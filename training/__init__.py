"""The run: its core at this level (start-up phases, the loop, one step, the optimizer, compile, each rank's data,
the DPO objective) and one room per concern: ``configuration/``, ``checkpoints/``, ``resilience/``, ``observation/``.
Layers and flow: docs/architecture.md."""
