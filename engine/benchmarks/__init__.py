"""Every benchmark behind bench.py's sub-commands: the speedup ablation (ablation.py, with its CPU
kernel rows in kernels.py), memory, decode formats and quality, serving under load, time to a
loss. runner.py starts each measurement in its own process (worker.py), report.py writes the
tables, JSON and plots, options.py checks the options."""
