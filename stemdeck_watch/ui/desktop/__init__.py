"""The desktop surface: the tray icon, notifications, opening folders and the page, and starting
the service at login. None of it is needed on a machine without a desktop.
"""
