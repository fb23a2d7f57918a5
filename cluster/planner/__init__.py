"""``pdserve plan``: an xPyD planner on a discrete-event simulation of the cluster (torch-free).

``profile``: the step-cost profile ``pdserve profile`` measures (``benchmarks.profile``);
``workload``: request mixes, arrivals and per-class SLOs (shared with ``bench serve``);
``simulator``: replicas running the engine's own scheduler, block manager and role hand-offs
in simulated time; ``plan``: every prefill/decode split of a device count and the colocated
alternatives, their predicted goodput and latency percentiles, the best split, a plot.
"""
