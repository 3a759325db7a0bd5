"""Serving over Ray: ingress (Ray Serve + FastAPI), OpenAI/native APIs, config, metrics, builders."""
