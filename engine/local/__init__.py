"""Everything that stands in for slime or a GPU: the embedded server, the demo, checks.

Membership: code that replaces a part of a real training job (the stand-in Sample, the CPU
SGLang-compatible server, the demo, `soak`, `bench`, the outside invariant checker). The
`run` command that uses them is the user's, and lives beside the CLI (`engine/run.py`).
Needs the `local` extra (torch, aiohttp, tqdm); never imported inside a slime job.
"""
