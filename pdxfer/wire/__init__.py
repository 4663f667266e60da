"""Message transport between processes: ZMQ sockets for the engine and admin channels
(sockets.py), the bootstrap channel between daemons over plain TCP (bootstrap.py).
Importing this package loads neither."""
