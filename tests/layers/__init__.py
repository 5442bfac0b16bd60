"""Tests of sits.layers building blocks."""
