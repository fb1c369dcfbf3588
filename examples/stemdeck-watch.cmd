@echo off
rem Written by `stemdeck-watch autostart`; config: C:\Users\you\AppData\Local\stemdeck-watch\stemdeck.toml
setlocal DisableDelayedExpansion
start "stemdeck-watch" /min C:\Users\you\stemdeck-watch\.venv\Scripts\stemdeck-watch.exe --config C:\Users\you\AppData\Local\stemdeck-watch\stemdeck.toml run
