"""Benchmarks of sits (and of any OpenAI-compatible server): reusable pieces.

- `workload`: client tenants and their seeded Poisson (or gamma) arrival schedules;
- `mix`: the `--tenants-mix` TOML file (client tenants with their own rates and SLOs);
- `prompts`: prompts of about N tokens for the served model (token ids or calibrated text);
- `probe`: before the run, find the model and choose and calibrate the prompt form;
- `client`: the async streaming client that times one request (TTFT, ITL, E2E);
- `records`: what was measured for one request; `metrics`: percentiles, TPOT, SLO
  attainment and goodput from records;
- `runner`: one run (probe, warm-up, send on schedule, collect); `errors`: BenchmarkError;
- `report`: the machine description, the JSON result and the tables printed from it;
- `serve`: `sits bench serve` (flags and the run);
- `server_proc`, `qos_compare`: `sits bench qos`, the same tenant mix against `sits serve`
  subprocesses with and without QoS;
- `fleet_procs`, `router_overhead`, `router_kill`: the fleet router's cost against direct
  connections to the same loopback replicas (paced fakes, `sits.testing.fake_replica`, or
  `sits serve`), and the requests lost when one replica is killed under load (issue 24);
- offline benchmarks of the engine itself: `offline` (`sits bench throughput`), `latency`
  (`sits bench latency`), with `offline_common` (flags, engine config, prompts, tables),
  `shapes` (named real model shapes for `--random-weights`), `steps` (what each engine step
  computed), `roofline` (bytes, FLOPs and ideal time of a step against the H200's ceilings)
  and `peer` (transformers' `generate_batch` on the same weights).

Nothing here imports the engine, the server or torch at import time (torch is only looked at,
lazily, to name the GPU in a report; the offline benchmarks import the engine when they run),
so the client runs against a remote server from any machine with httpx.
"""
