"""The command line: strata-bench (run, sweep, plan, stage, make-model) and its tables and progress lines."""
