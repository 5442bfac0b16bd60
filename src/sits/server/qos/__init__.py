"""The server's quality of service: admission in front of the engine, overload, QoS headers.

- `admit`: `require_tenant` authenticates each request's tenant (API key, router key);
  `ServerQos` (tenants, rate limits, circuit breaker, overload policy) admits each request and
  records its outcome; `rejection_error` is the 429 body the router shares;
- `overload_watch`: samples the engine's load on a timer and sets the overload state;
- `headers`: the middleware putting the overload state and rate-limit headers on responses;
- `metrics`: the QoS gauges read at scrape time.
Nothing is imported here, so `sits.router` can import `admit` without the rest of the server.
"""
