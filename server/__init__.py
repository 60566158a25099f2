"""The OpenAI-compatible HTTP server: `gunicorn server.app` or `python -m server --model ... --port ...`."""
