"""layers layer."""
