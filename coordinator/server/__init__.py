"""shoal serve: the HTTP server (http_server.py) and what every API it speaks shares
(answering.py, batching.py, grammars.py, tools.py), the OpenAI, Anthropic and Ollama APIs' shapes,
the limits and access log, and the dashboard with its page (static/) and metrics."""
