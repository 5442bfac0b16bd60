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
  and `peer` (transformers' `generate_batch` on the same weights);
- what the scripts of bench/ run (`python bench/NAME.py` is `python -m sits.bench.NAME`):
  `profile_step` (the kernels of decode, prefill, mixed and replayed steps), `step_costs`
  (step wall and runner time by shape), `device_busy` (device idle time between steps),
  `host_overhead` (host cost of a step by part), `prefix_ttft` and `kv_tiers` (issue 7's
  prefix cache and host tier), `qos_sim` (QoS vs FCFS with a modelled device) and `loop_lag`
  (the server's event-loop lag, engine in a thread or a process); for `bench/qos/`,
  `qos_calibrate` (a mix's rates from a measured capacity), `qos_combine` (single-mode
  results in one comparison) and `listen_queue` (the kernel's accept queues).

The serving client's modules import neither the engine, the server nor torch (torch is only
looked at, lazily, to name the GPU in a report), so the client runs against a remote server from
any machine with httpx; the engine benchmarks import the engine (and some torch) themselves.
"""
