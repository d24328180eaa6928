"""High availability: leader election (etcd), the serving gate, fencing and durable EPLB
maps. Nothing here runs with ``ha.backend: none``.

- :mod:`.gate`: whether this daemon may serve fulcrum.v1 *now* (a monotonic deadline),
  and the calls in flight it closes when the deadline passes;
- :mod:`.elector`: the :class:`~.elector.Elector` protocol a backend implements;
- :mod:`.etcd`: the etcd backend (etcd's v3 gRPC API through ``aetcd``'s protos);
- :mod:`.interceptor`: refuses fulcrum.v1 calls off the leader (UNAVAILABLE with
  ``x-fulcrum-leader``) and closes open calls when the gate closes;
- :mod:`.maps`: EPLB maps written to etcd, guarded by the leadership, before they apply;
- :mod:`.runtime`: wires them into a daemon (health, metrics, logs, exit on lost lease).
"""
