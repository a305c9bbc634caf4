"""Tools that use both sides: the ``remoteloader`` command (serve, demo, pack, probe), local
server processes, and generated JPEG datasets.

The client (``remoteloader.client``) and the server (``remoteloader.server``) never import
this package; it may import both (tests/test_layers.py holds every side to that).
"""
