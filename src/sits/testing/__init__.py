"""Helpers for tests and demos: tiny random checkpoints and tokenizers made locally."""
