"""The HTTP ingress process and the `radixray serve` command: the Ray Serve deployment,
FastAPI routes, the OpenAI and native APIs, dispatch to the engine workers, builders."""
