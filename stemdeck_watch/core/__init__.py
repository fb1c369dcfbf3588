"""What every part speaks: jobs, events and errors, the settings, where things live, and the
service lock."""
