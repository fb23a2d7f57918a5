"""The Ray Serve layer, shared by the roles: streaming pool calls with retries (``calls``),
deployment options (``options``), the pools' request routers and their routing policy
(``routers``, ``routing_policy``), metrics (``metrics``), autoscaling signals and policies
(``signals``, ``autoscaling``), and the base of both pool replicas (``replica``).

Torch-free: the router and the Serve controller import it.
"""
