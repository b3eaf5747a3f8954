"""serve.py's machinery: its options (options.py), the HTTP app (app.py), continuous batching
(batching.py), the worker supervisor (supervisor.py), log-probabilities (logprobs.py) and the
playground page (playground.py)."""
