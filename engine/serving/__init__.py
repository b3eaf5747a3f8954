"""serve.py's machinery: the HTTP app (app.py), continuous batching (batching.py), the worker
supervisor (workers.py), log-probabilities (logprobs.py) and the playground page."""
