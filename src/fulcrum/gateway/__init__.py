"""Fulcrum as an endpoint picker (EPP) behind an Envoy-based gateway (Gateway API
Inference Extension): ext_proc servicer, body parsing, endpoints, metrics, and the one
adapter to the balancers' state (:mod:`fulcrum.gateway.adapter`)."""
