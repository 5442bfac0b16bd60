"""Tests of sits.kernels references."""
