"""Fulcrum: a scheduling control plane for disaggregated Mixture-of-Experts LLM inference."""

__version__ = "0.1.0"
