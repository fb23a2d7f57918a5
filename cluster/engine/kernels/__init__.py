"""pdserve's native CPU kernels: one shared library built from the C sources in this directory.

- ``build.py``: the sources, flags and build (``make setup`` and the wheel build it into the
  package; the engine compiles it into its cache on first use where neither did).
- ``library.py``: finds and loads it, or logs why not (the engine then uses torch).
- ``native.py``: its functions on torch tensors (linear over every weight format, F32 included;
  row de-quantization; RMSNorm, RoPE, SwiGLU, the KV write; paged decode attention over fp32
  and int8 KV). ``decode_forward.py``: a decode step's layers in one call.
- ``quant.py``: the weight formats and their torch de-quantization (the reference).

Each C function has AVX-512, AVX2 and / or portable variants and picks one at run time from the
CPU (``pool.c``); all parallel work runs on the library's one thread pool (``pool.c``).
"""
