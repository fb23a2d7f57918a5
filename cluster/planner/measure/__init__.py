"""What ``pdserve profile`` and ``pdserve plan --validate`` measure on this machine.

These modules run the engine and the serving stack; the rest of the planner is torch-free (an
import contract in pyproject.toml names the torch-free modules). ``engine``: engine steps and
KV pulls; ``deploy`` and ``load``: arms deployed side by side on a local Ray Serve instance and
the gRPC load sent to them; ``arms``: the serving arms and how they are measured (shared with
``bench serve``); ``profiler``: ``pdserve profile``; ``validate``: ``pdserve plan --validate``;
``machine``: what other work and the hypervisor took from the cores meanwhile.
"""
