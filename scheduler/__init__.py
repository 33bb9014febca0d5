"""``kvpool.scheduler``: where each request runs.

Cost model (``cost_model``), the location index and caches (``index``), the cluster
state and placement arithmetic (``cluster``), routing policies (``policy_*``, registry
in ``policies``), the discrete-event trace replayer (``simulator``, ``runner``,
``metrics``) and the router daemon's core and transports (``router_*``). See
docs/scheduler.md. Submodules are imported explicitly; this package imports nothing.
"""
