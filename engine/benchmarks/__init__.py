"""bench.py's sub-commands, one module each; timing.py runs each measurement in its own process
(worker.py) and reads its clocks and memory, report.py writes the pages, checks.py checks the
options."""
