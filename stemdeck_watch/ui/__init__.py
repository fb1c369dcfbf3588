"""What a person touches: the local API and its queue page, the synced-folder controls, the tray
icon, notifications, and starting at login (autostart).

Everything here talks only to the scheduler (the one door into the queue) and the event bus;
nothing here reaches into the pipeline, the registry or the intake.
"""
