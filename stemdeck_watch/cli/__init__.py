"""The command line: `stemdeck-watch` and its commands (run, status, doctor, demo, the
commands that steer the running service), and the logging they set up."""
