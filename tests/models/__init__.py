"""Tests of sits.models: parity with transformers, the loader, tiny checkpoints."""
