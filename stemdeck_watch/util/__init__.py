"""Small utilities that know nothing of jobs: safe files and text, redacted URLs, tickers,
retrying, synthetic songs, config value checks."""
