"""The daemon shell: wiring and lifecycle (server.py), the admin API, metrics, the
HTTP endpoint, etcd registry, start-up checks. The only layer that knows them all."""
