"""Measurements of this machine that the planner uses: the topology's micro-benchmarks, the learned
cost model's designed placements, a shortlist's plans (``neorec plan --calibrate / --tune`` run these
in subprocesses, so that the planner itself never imports torch)."""
