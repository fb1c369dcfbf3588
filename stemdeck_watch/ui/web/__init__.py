"""The web surface: the HTTP API and its OpenAPI document, the live stream, the queue page, the
player's media, uploads and links from the page, and how the CLI finds and calls the service.

Everything a browser or the CLI reaches over HTTP is here, behind one set of checks (`api.py`).
"""
