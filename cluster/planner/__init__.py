"""``pdserve plan``: an xPyD planner on a discrete-event simulation of the cluster.

``profile``: the step-cost profile ``pdserve profile`` measures (``measure.profiler``);
``calibration``: its serving section from requests a local cluster served;
``workload``: request mixes, arrivals and per-class SLOs (shared with ``bench serve``);
``simulator``: replicas running the engine's own scheduler, block manager and role hand-offs
in simulated time; ``plan``: every prefill/decode split of a device count and the colocated
alternatives, their predicted goodput and latency percentiles, the best split, a plot.
``measure``: what ``pdserve profile`` and ``pdserve plan --validate`` measure on the machine,
the one part of the planner that runs the engine (the rest is torch-free).
"""
