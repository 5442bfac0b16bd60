"""sched layer."""
