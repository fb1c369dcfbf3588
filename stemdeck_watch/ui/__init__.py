"""What a person touches: the web surface (`web/`: the API, its queue page and sign-in), the
desktop one (`desktop/`: the tray icon, notifications, opening folders, starting at login), and
the synced-folder controls (`folder.py`).

Everything here talks only to the scheduler (the one door into the queue) and the event bus;
nothing here reaches into the pipeline, the registry or the intake.
"""
