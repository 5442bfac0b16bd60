"""L8 server: the OpenAI-compatible HTTP API on the engine (`sits serve`).

`app.build_app(engine, settings)` builds the FastAPI app; `uvicorn_server.run_app` serves it
under uvicorn with drain-on-SIGTERM. Per-request QoS (admission, overload, headers, gauges) is
the `qos` subpackage; metrics, timelines, cost and audit are `sits.obs`'s, the routes that
serve them (`routes.py`, `routes_dashboard.py`) are here. The server never imports runner,
models or kernels: it talks to the engine only through `engine_client.EngineClient`
(`sits.engine.async_llm.AsyncLLM`).
"""
