"""shoal serve: the HTTP server (http_server.py) and what every API shares (answering.py; the
batch engine, its prompt cache tiers and request text; grammars.py, tools.py), the OpenAI,
Responses, Anthropic and Ollama APIs' shapes, limits, access log, dashboard and metrics."""
