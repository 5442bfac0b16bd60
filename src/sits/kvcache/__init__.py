"""kvcache layer."""
