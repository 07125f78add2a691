"""Processes of a run: the ``--nproc`` launcher, its workers, Ctrl-C and signals.

``agent``: the launcher (PyTorch's elastic agent in this process), ``Nodes``, ``Recovery`` and
the job's restarts; ``elastic``: the agent's seams replaced (workers tied to the launcher from
their fork, stopped workers ended, ``--max-restarts``); ``worker``: what a worker runs around its
work (the launcher watchdog, its rank group, its failures handed on); ``messages``: the failure
reports and the one lines a failed or interrupted run prints.
"""
