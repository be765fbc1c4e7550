"""Everything that stands in for slime or a GPU: the run command, the embedded server, checks.

Membership: code that replaces a part of a real training job (the stand-in Sample, the CPU
SGLang-compatible server, the demo, `run`, `soak`, `bench`, the outside invariant checker).
Needs the `local` extra (torch, aiohttp, tqdm); never imported inside a slime job.
"""
