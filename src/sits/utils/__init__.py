"""utils layer."""
