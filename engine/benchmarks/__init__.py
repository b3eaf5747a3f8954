"""bench.py's sub-commands, one module each; runner.py runs each measurement in its own process
(worker.py), report.py writes the pages, options.py checks the options."""
