"""Layer-wise KV streaming on prefill: each layer's new full pages are written while the forward
computes the next layers. A transfer mode beside the chunk-wise submitter, sharing its room
registry, planner, peers' in-flight budget, completion and failure path.

hooks.py (SGLang's HookRegistry: run_batch, attention forward, radix checkpoint) -> session.py
(publish a batch, collect layers, filter send()) -> worker.py (post layer groups) ; ranges.py and
mapping.py are the pure arithmetic; planner.py filters one plan per layer group; assembly.py
decides at start-up whether this deployment can stream.
"""
