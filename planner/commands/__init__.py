"""The command line, one module per group of commands; planner/cli.py assembles them."""
