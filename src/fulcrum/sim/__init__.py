"""Trace-replay simulator: the core policies on a virtual clock, against the ideal.

* :mod:`fulcrum.sim.workload` -- requests, trace readers (Mooncake, Azure, ServeGen),
  rate and length scaling; :mod:`fulcrum.sim.synthetic` -- long-context agent sessions,
  screenshots and tier surges;
* :mod:`fulcrum.sim.cache` -- the LRU prefix-block cache;
* :mod:`fulcrum.sim.cluster` -- the cluster model (YAML) and its documented defaults;
* :mod:`fulcrum.sim.experts` -- drifting expert popularity and the EPLB loop;
* :mod:`fulcrum.sim.policies` / :mod:`fulcrum.sim.baselines` -- policy sets;
* :mod:`fulcrum.sim.engine` -- the discrete-event loop;
* :mod:`fulcrum.sim.report` -- summaries, tables, JSON, plots;
* :mod:`fulcrum.sim.scenarios` -- named workloads and load calibration;
* :mod:`fulcrum.sim.cli` -- ``fulcrum simulate``.
"""
