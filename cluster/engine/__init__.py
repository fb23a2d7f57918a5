"""The engine shared by both pools: paged KV cache, scheduler, model runners, sampler."""
