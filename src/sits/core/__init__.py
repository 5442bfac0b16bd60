"""L1 core types: requests, sampling parameters, outputs and the step plan/result messages."""
