"""The analytic models that predict: host, HBM, rank and request memory; topologies and their links; the policy
that ranks (dp, sp, mode, slots, R, load group) plans; waves and dispatch of requests to replicas; the constants
calibrated on published deployments and measured machines. Pure functions on frozen data: they read the plan
(:mod:`dlo_fn.plan`) and never the runtime, which loads them only when asked to choose (``mode="auto"``) or a
planner command runs."""
