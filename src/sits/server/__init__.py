"""L8 server: the OpenAI-compatible HTTP API on the engine (`sits serve`).

`app.build_app(engine, settings)` builds the FastAPI app; `runner.run_app` serves it under
uvicorn with drain-on-SIGTERM. The server never imports runner, models or kernels: it talks to
the engine only through `engine_client.EngineClient` (`sits.engine.async_llm.AsyncLLM`).
"""
