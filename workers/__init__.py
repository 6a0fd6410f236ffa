"""Worker runtime: one Ray actor per device in one torch.distributed world (see docs/workers.md).

Entry points: `tidal.workers.runtime.WorkerGroup` (and `start_from_config` for the CLI),
`tidal.workers.compute_share.ComputeShare`. Nothing is imported here so that `import tidal.workers.x`
stays cheap (Ray is imported only when a group starts).
"""
