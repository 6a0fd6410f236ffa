"""tidal.workers: the device workers. One long-lived Ray actor per device id, all of them ranks of one
torch.distributed world, and what a device does in the RL pipeline. See docs/workers.md.

Entry points:
- `runtime`: `WorkerGroup.start(devices, device_kind, compute_share, ray_address, cpu_cores=...)`, then
  `submit` / `submit_all` / `gather`, `call` / `call_all`, `interrupt`, `health`, `check`, `shutdown`; a call
  names a module-level function (`probes.allreduce_sum`, or its path `"tidal.workers.probes:allreduce_sum"`):
  only its name crosses to the worker, which imports it and runs `fn(ctx, **kwargs)`; a call by function is
  typed (its keywords checked against `fn`, a `CallHandle[R]` of its result); `put` / `get` / `wait_ready`: the
  object store, so that no caller imports Ray; `start_from_config(cluster)` starts the workers a `ClusterConfig`
  describes;
- `endpoints`: `ActorCalls`, `RolloutCalls`, `InferenceCalls`, `WorkerCalls` (`Endpoints.on(group)`): each role
  function the driver calls as a typed method returning typed `CallHandle`s;
- `device_worker` (`DeviceWorker`, the actor body; `WorkerContext`: device id, rank, device, world group, the
  `state` dict kept between calls), `errors` (`WorkerDied`, `WorkerTimeout`, `WorkerCallError`), `ray_env`
  (`connect`, `ray_listeners`), `compute_share` (`ComputeShare.apply` / `release`, `pin_process`), `gc_pauses`;
- role functions the driver calls: `roles` (setup, actor_*, rollout_*, inference_*, evaluate; a worker's role
  state is one typed `WorkerRoles`), `roles_ckpt` (`actor_save`, `actor_load`), `messages` (the typed records
  crossing the boundary: `RolloutReport`, `MigrationPackage`, `ExportReceipt`, `MoveResult`, `ReshardReport`,
  `HandoverReport`, `RankWeights`, `KeptWeights`), `cost_probes` (decode and prefill timings for the CPU cost
  model), over `rollout_instance` (`RolloutInstance`, `GroupQueue`, `migrate_groups`: plain objects, no Ray);
  `probes` (small functions for tests and cluster checks).

Imports: `tidal.engine.*`, `tidal.core.errors` and itself; Ray and torch. Never `tidal.core.config` (a
`ClusterConfig` is read by attribute), the scheduler, pipeline, db, flows, tasks or tracking. Importing a module
here costs no Ray import: `runtime` imports Ray when a group starts, `device_worker` costs torch only.

Invariants:
- workers are addressed by device id; a worker's rank is the position of its id in the list given to `start`;
- calls to one worker run one at a time, in order; `health` and `interrupt` run in a separate control group, so
  they answer while a long call runs;
- a worker whose process dies is reported as `WorkerDied(device_id)` by the next `gather` / `call` / `check`
  within about `poll_s`, never a hang; after a death the group is broken (shut it down and start another)
  unless the caller `retire`s the device and needs no collective over the whole world any more;
- tensors move over torch.distributed (gloo on CPU, NCCL on GPU); values through Ray are records and small dicts;
  with an embedded Ray, Ray and the world's rendezvous listen on 127.0.0.1 only and Ray's gRPC needs a token;
- every worker holds an actor backend (`actor.backend`, `tidal.engine.backends.protocol.ActorBackend`: group
  creation and reshard votes are collective), holding memory only while its device is in the actor's layout;
- a rollout group's samples are seeded by `derive_seed(run_seed, step, group_id, k)`, so their tokens do not
  depend on the instance or migrations; a migrated group is emitted exactly once, by its target;
- inference scores each group as its own batch, so a dynamic run stays bit-identical to a static one;
- a compute share is a cap, not a reservation: idle capacity is lost, as on a GPU.
"""
