"""Actor checkpoints: atomic generations of per-rank shard files, loadable into any layout.

A checkpoint directory holds generations; only a generation with its marker counts::

    <dir>/gen-4/                       a complete generation (step 4 = RL steps completed)
        shard-tp0-dp0.safetensors      rank (t, d) of the saved layout: param, master, exp_avg, exp_avg_sq over
        shard-tp0-dp1.safetensors      its ZeRO-owned ranges (optimizer order), rng (uint8), scalars (int64:
        ...                            optimizer step, data cursor); no pickle anywhere
        manifest.json                  model args, param specs, layout, dtype, seed, step, data position,
                                       policy version, every shard's sha256 and size
        COMPLETE                       written last; holds the sha256 of manifest.json
    <dir>/gen-6/ ...                   the newest; keep_last=2 keeps gen-4 as the previous generation
    <dir>/tmp-8/                       a write in progress or a crashed one: never read, removed by the next save

Writing a generation (who does what; `save_actor` runs it all, the pipeline splits it worker/driver)::

    first rank (or driver)  begin(dir, step)       refuse a complete gen-<step>; drop a stale tmp-<step>
    every layout rank       write_shard            safetensors bytes, fsync         --fault("shard") mid-file
                            gather_records         all-gather (ok, sha256, size) over the layout: a rank that
                                                   failed makes every rank raise, nobody writes a manifest
    layout's first device   write_manifest         manifest.json, fsync             --fault("manifest")
    first rank (or driver)  commit                 fsync dir; rename tmp -> gen     --fault("rename")
                                                   COMPLETE via rename, fsync       --fault("marker")
                                                   prune to the newest keep_last complete generations

A crash at any point leaves the previous generation untouched and the new one without its marker (ignored).
Saving the step of an existing complete generation is refused: nothing is ever overwritten.

Loading (`load_actor`, collective over the world like a reshard): the saved layout is the reshard planner's "from"
layout and the files replace point-to-point transfers. New rank (t, d) reads exactly the boxes it needs: its
optimizer ranges from the `plan_reshard` optim moves, its TP shard of the weights from the saved owned ranges
of every saved DP rank of the source TP index (the planner's region arithmetic: `holdings`, `intersect`,
`region`), each as a slice of a memory-mapped file (`safe_open(...).get_slice`), so no rank reads the full model
unless its layout holds it. Step, data cursor and RNG follow the planner's `MetaMove` rule: same coordinates
keep their generator, new ones are seeded by `rng_seed(seed, step, t, d)`. Hence a load at B equals the in-memory
reshard A -> B bit for bit. Commit is two-phase: every rank reads into new buffers, the world votes, and only if
all succeeded does each rank swap (`ActorShard.adopt`); otherwise every rank keeps its state and raises.

Checks before anything is touched: the manifest's model args and param specs against the loading actor
(`CheckpointError` names the field), and the sha256 of every file a rank reads (a flipped byte names the file).
`latest(dir)` returns the newest generation with its marker whose checksums verify, skipping (and logging)
broken ones.

    rec = save_actor(shard, "ckpt", CheckpointMeta(step=4, data_pos=64, policy_version=4))
    gen = latest("ckpt")                       # Path("ckpt/gen-4")
    manifest = load_actor(shard, gen, Layout.parse("tp=2,dp=1,devices=2-3"))
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save as st_save

from tidal.core.errors import PeerFailed, TidalError
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.model import check_tp
from tidal.engine.optim import OPT_KINDS, ShardState, ZeroShape, rng_seed
from tidal.engine.reshard import Move, plan_reshard
from tidal.engine.reshard.execute import Region, region
from tidal.engine.reshard.plan import holdings, intersect, shard_box, source_ts

log = logging.getLogger("tidal.checkpoint")

FORMAT = "tidal-actor-checkpoint/1"
MANIFEST = "manifest.json"
MARKER = "COMPLETE"
KINDS = ("param",) + OPT_KINDS
Fault = Callable[[str], None] | None


class CheckpointError(TidalError):
    """A checkpoint that cannot be written or loaded: names the file or field and the fix (CLI exit 2)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """Driver-side position of the run at the checkpoint."""

    step: int              # RL steps completed; the generation is gen-<step> and a resumed run starts at it
    data_pos: int          # prompts the driver's data stream has consumed (in epoch `data_epoch`)
    policy_version: int    # weight version rollout and inference hold
    data_epoch: int = 0    # epoch of a data-file stream (built-in tasks: always 0)


@dataclass(frozen=True)
class ShardRecord:
    """One saved rank's file."""

    file: str
    sha256: str
    nbytes: int
    t: int
    d: int


@dataclass(frozen=True)
class Manifest:
    meta: CheckpointMeta
    model: dict                      # ModelArgs fields
    specs: tuple[ParamSpec, ...]
    layout: Layout                   # the saved ("from") layout
    param_dtype: str                 # "float32" / "bfloat16": dtype of the saved param tensors
    device_type: str                 # where the RNG states come from ("cpu" / "cuda")
    seed: int
    optimizer_step: int
    data_cursor: int
    shards: tuple[ShardRecord, ...]

    def to_json(self) -> dict:
        return {"format": FORMAT, "meta": asdict(self.meta), "model": self.model,
                "specs": [[s.name, list(s.shape), s.tp_dim] for s in self.specs],
                "layout": {"tp": self.layout.tp, "dp": self.layout.dp, "devices": list(self.layout.devices)},
                "param_dtype": self.param_dtype, "device_type": self.device_type, "seed": self.seed,
                "optimizer_step": self.optimizer_step, "data_cursor": self.data_cursor,
                "shards": [asdict(r) for r in self.shards]}

    @staticmethod
    def from_json(obj: dict) -> Manifest:
        lay = obj["layout"]
        return Manifest(CheckpointMeta(**obj["meta"]), dict(obj["model"]),
                        tuple(ParamSpec(n, tuple(s), t) for n, s, t in obj["specs"]),
                        Layout(lay["tp"], lay["dp"], tuple(lay["devices"])), obj["param_dtype"], obj["device_type"],
                        int(obj["seed"]), int(obj["optimizer_step"]), int(obj["data_cursor"]),
                        tuple(ShardRecord(**r) for r in obj["shards"]))

    def shard(self, t: int, d: int) -> ShardRecord:
        return next(r for r in self.shards if (r.t, r.d) == (t, d))


# ---- files ----------------------------------------------------------------------------------------------------
def gen_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"gen-{step}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"tmp-{step}"


def shard_name(t: int, d: int) -> str:
    return f"shard-tp{t}-dp{d}.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes, fault: Fault = None, phase: str = "") -> None:
    with open(path, "wb") as f:
        if fault is not None:  # a crash mid-write leaves a truncated file behind, as a real one would
            f.write(data[:len(data) // 2])
            f.flush()
            fault(phase)
            f.write(data[len(data) // 2:])
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _step_of(p: Path, prefix: str) -> int | None:
    tail = p.name[len(prefix):]
    return int(tail) if p.name.startswith(prefix) and tail.isdigit() else None


def generations(root: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, path, has marker) of every gen-* directory, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(s, p, (p / MARKER).is_file()) for p in root.iterdir() if (s := _step_of(p, "gen-")) is not None]
    return sorted(out, reverse=True)


# ---- writing --------------------------------------------------------------------------------------------------
def begin(root: str | Path, step: int) -> Path:
    """Make a fresh tmp-<step> (a stale one is a crashed write: never loadable, removed). Refuses a step whose
    generation is already complete: nothing is overwritten."""
    root = Path(root)
    final = gen_dir(root, step)
    if (final / MARKER).is_file():
        raise CheckpointError("checkpoint.step", step, f"{final} already holds a complete checkpoint",
                              "checkpoint into another directory, or delete that generation first")
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _pack(flat: torch.Tensor, shape: ZeroShape) -> torch.Tensor:
    """The owned ranges of a TP-local flat tensor, in optimizer order (same order as master)."""
    segs = shape.owned_segments()
    if not segs:
        return flat.new_empty(0)
    return torch.cat([flat[p:p + n] for p, _, n in segs])


class PeerCheckpointError(CheckpointError, PeerFailed):
    """This rank's shard was fine; another rank of the layout failed to write its own."""


def write_shard(shard, tmp: str | Path, fault: Fault = None) -> ShardRecord | None:
    """This rank's file (None outside the layout): its owned ranges of every buffer, RNG and scalars."""
    st: ShardState | None = shard.state
    if st is None:
        return None
    t, d = shard.coord
    tensors = {"param": _pack(st.flat_param, st.shape)}
    tensors.update({k: st.buffer(k) for k in OPT_KINDS})
    tensors["rng"] = st.rng.get_state()
    tensors["scalars"] = torch.tensor([st.step, st.data_cursor], dtype=torch.int64)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    meta = {"format": FORMAT, "t": str(t), "d": str(d), "layout": str(shard.layout)}
    data = st_save(tensors, metadata=meta)
    name = shard_name(t, d)
    try:
        _write_durable(Path(tmp) / name, data, fault, "shard")
    except OSError as err:   # a full disk, a read-only or vanished folder: the rank and the OS say which
        raise CheckpointError("checkpoint", str(Path(tmp) / name), f"cannot be written by rank {shard.rank} "
                              f"({err.strerror or err}; {len(data):,} bytes)",
                              "free space or fix the folder's permissions; the previous generation is "
                              "untouched") from None
    return ShardRecord(name, hashlib.sha256(data).hexdigest(), len(data), t, d)


def gather_records(shard, mine: ShardRecord | None, error: BaseException | None) -> list[ShardRecord]:
    """All-gather every layout rank's record (collective over the layout). If any rank failed, every rank raises
    (the failing one its own error), so no manifest is written and no rank waits forever."""
    lay = shard.layout
    g = shard.groups.get(lay)
    row = torch.zeros(35, dtype=torch.int64, device=shard.device)
    if mine is not None and error is None:
        row[0] = 1
        row[1:33] = torch.tensor(list(bytes.fromhex(mine.sha256)), dtype=torch.int64)
        row[33], row[34] = mine.nbytes, lay.devices.index(shard.rank)
    rows = [row]
    if g.all is not None:
        rows = [torch.empty_like(row) for _ in range(lay.size)]
        dist.all_gather(rows, row, group=g.all)
    if error is not None:
        raise error
    rows = [r.cpu() for r in rows]
    failed = [rank for rank, r in zip(sorted(lay.devices), rows) if not int(r[0])]
    if failed:
        raise PeerCheckpointError("checkpoint", str(lay), f"actor rank(s) {failed} failed to write their shards",
                                  "see that rank's error; the previous generation is untouched")
    out = []
    for r in rows:
        k = int(r[34])
        t, d = k % lay.tp, k // lay.tp
        out.append(ShardRecord(shard_name(t, d), bytes(r[1:33].tolist()).hex(), int(r[33]), t, d))
    return sorted(out, key=lambda x: (x.d, x.t))


def make_manifest(shard, meta: CheckpointMeta, records: list[ShardRecord]) -> Manifest:
    st = shard.state
    return Manifest(meta, asdict(shard.args), shard.specs, shard.layout, str(shard.dtype).removeprefix("torch."),
                    shard.device.type, shard.seed, st.step, st.data_cursor, tuple(records))


def write_manifest(tmp: str | Path, manifest: Manifest, fault: Fault = None) -> None:
    data = json.dumps(manifest.to_json(), indent=1).encode()
    _write_durable(Path(tmp) / MANIFEST, data)
    if fault is not None:
        fault("manifest")


def commit(root: str | Path, step: int, keep_last: int = 2, fault: Fault = None) -> Path:
    """Publish tmp-<step> as gen-<step>: fsync, rename, then the marker (last), then prune old generations."""
    root, tmp, final = Path(root), tmp_dir(root, step), gen_dir(root, step)
    mpath = tmp / MANIFEST
    if not mpath.is_file():
        raise CheckpointError("checkpoint", str(tmp), "has no manifest.json (the shard writes did not finish)",
                              "save again; the previous generation is untouched")
    digest = file_sha256(mpath)
    _fsync_dir(tmp)
    if (final / MARKER).is_file():
        raise CheckpointError("checkpoint.step", step, f"{final} already holds a complete checkpoint",
                              "checkpoint into another directory, or delete that generation first")
    if final.exists():
        shutil.rmtree(final)  # renamed by a write that crashed before its marker: never loadable
    if fault is not None:
        fault("rename")
    os.rename(tmp, final)
    _fsync_dir(root)
    if fault is not None:
        fault("marker")
    _write_durable(final / (MARKER + ".tmp"), digest.encode())
    os.rename(final / (MARKER + ".tmp"), final / MARKER)
    _fsync_dir(final)
    prune(root, keep_last)
    return final


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` complete generations; drop older ones and leftovers older than the newest."""
    gens = generations(root)
    complete = [s for s, _, ok in gens if ok]
    if not complete:
        return []
    keep = set(complete[:max(1, keep_last)])
    dropped = []
    for s, p, ok in gens:
        if s not in keep and (ok or s < complete[0]):
            shutil.rmtree(p)
            dropped.append(p)
    for p in Path(root).iterdir():
        tmp_step = _step_of(p, "tmp-")
        if tmp_step is not None and tmp_step < complete[0]:
            shutil.rmtree(p)
            dropped.append(p)
    return dropped


def save_actor(shard, root: str | Path, meta: CheckpointMeta, keep_last: int = 2, fault: Fault = None) -> Path | None:
    """Every rank of the actor's layout (others return None at once): write a generation and commit it. The
    layout's first device does begin/manifest/commit; returns the generation's path there, None elsewhere."""
    if shard.state is None:
        return None
    lead = shard.rank == shard.layout.devices[0]
    g = shard.groups.get(shard.layout)
    tmp, mine, error = tmp_dir(root, meta.step), None, None
    try:
        if lead:
            begin(root, meta.step)
    except Exception as e:
        error = e
    if g.all is not None:  # the temp dir exists before anyone writes; if begin failed, nobody writes
        flag = torch.tensor([0 if error else 1], dtype=torch.int32, device=shard.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g.all)
        if not flag.item() and error is None:
            error = CheckpointError("checkpoint", str(root), "the layout's first rank could not start the "
                                    "generation", "see that rank's error")
    if error is None:
        try:
            mine = write_shard(shard, tmp, fault)
        except Exception as e:
            error = e
    try:
        records = gather_records(shard, mine, error)
    except BaseException:   # every rank raises here together; a partial generation must not fill the disk
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not lead:
        return None
    write_manifest(tmp, make_manifest(shard, meta, records), fault)
    return commit(root, meta.step, keep_last, fault)


# ---- reading --------------------------------------------------------------------------------------------------
def read_manifest(gen: str | Path) -> Manifest:
    """The manifest of a complete generation, checked against its marker (not the shard checksums: `verify`)."""
    gen = Path(gen)
    marker, mpath = gen / MARKER, gen / MANIFEST
    if not marker.is_file():
        raise CheckpointError("checkpoint", str(gen), "is not a complete checkpoint generation (no COMPLETE "
                              "marker: the write did not finish, or this is not a generation directory)",
                              "pass the checkpoint directory to resume from its latest complete generation")
    if not mpath.is_file():
        raise CheckpointError("checkpoint", str(mpath), "is missing", "resume from another generation")
    if file_sha256(mpath) != marker.read_text().strip():
        raise CheckpointError("checkpoint", str(mpath), "does not match the sha256 in its COMPLETE marker "
                              "(corrupted)", "resume from the previous generation, or delete this one")
    try:
        obj = json.loads(mpath.read_text())
        if obj.get("format") != FORMAT:
            raise CheckpointError("checkpoint", str(mpath), f"has format {obj.get('format')!r}, expected "
                                  f"{FORMAT!r}", "load it with the Tidal version that wrote it")
        manifest = Manifest.from_json(obj)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError("checkpoint", str(mpath), f"cannot be read ({type(e).__name__}: {e})",
                              "resume from another generation") from None
    for rec in manifest.shards:   # a shard is a plain file name inside its generation, never a path elsewhere
        if rec.file != shard_name(rec.t, rec.d):
            raise CheckpointError("checkpoint", rec.file, f"is not the shard file name of rank (t={rec.t}, d={rec.d}) "
                                  f"in {mpath} (shards are {shard_name(0, 0)!r}-style names inside the generation)",
                                  "resume from another generation; this manifest was not written by Tidal")
    return manifest


def verify_file(gen: Path, rec: ShardRecord) -> None:
    path = Path(gen) / rec.file
    fix = f"resume from the previous generation (latest() skips this one), or delete {gen}"
    if not path.is_file():
        raise CheckpointError("checkpoint", str(path), "is missing", fix)
    size = path.stat().st_size
    if size != rec.nbytes:
        raise CheckpointError("checkpoint", str(path), f"has {size} bytes, the manifest says {rec.nbytes} "
                              "(truncated or corrupted)", fix)
    digest = file_sha256(path)
    if digest != rec.sha256:
        raise CheckpointError("checkpoint", str(path), f"sha256 {digest[:16]}... does not match the manifest's "
                              f"{rec.sha256[:16]}... (corrupted)", fix)


def verify(gen: str | Path) -> Manifest:
    """Marker, manifest and every shard's size and sha256; raises CheckpointError naming the bad file."""
    m = read_manifest(gen)
    for rec in m.shards:
        verify_file(Path(gen), rec)
    return m


def latest(root: str | Path) -> Path | None:
    """The newest generation under `root` that has its marker and verifies (broken ones are logged, skipped)."""
    for _step, path, ok in generations(root):
        if not ok:
            continue
        try:
            verify(path)
            return path
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


def check_model(m: Manifest, args, specs: tuple[ParamSpec, ...], where: str) -> None:
    """The checkpoint must be of this model: every ModelArgs field and the param inventory."""
    ours = asdict(args)
    for k in sorted(set(ours) | set(m.model)):
        if m.model.get(k) != ours.get(k):
            raise CheckpointError(f"model.{k}", m.model.get(k), f"checkpoint {where} was written by a model with "
                                  f"model.{k}={m.model.get(k)!r}, this run has {ours.get(k)!r}",
                                  f"set model.{k}: {m.model.get(k)!r} to resume it, or resume from a checkpoint "
                                  "of this model")
    if tuple(m.specs) != tuple(specs):
        bad = next((a, b) for a, b in zip(m.specs + (None,) * len(specs), specs + (None,) * len(m.specs)) if a != b)
        raise CheckpointError("checkpoint.specs", bad[0], f"parameter inventory of {where} differs from this "
                              f"model's ({bad[1]})", "resume with the model code that wrote the checkpoint")


def load_moves(old: Layout, new: Layout, specs: tuple[ParamSpec, ...], dst: int) -> list[Move]:
    """What new rank `dst` reads: optim moves straight from the reshard plan; param moves from the saved owned
    ranges (files hold each weight once, on its ZeRO owner) of the planner's source TP index."""
    plan = plan_reshard(old, new, specs)
    moves = [m for m in plan.moves if m.dst == dst and m.what == "optim"]
    t_new, _ = cast("tuple[int, int]", new.coord(dst))  # a rank of `new`
    for i, spec in enumerate(specs):
        box = shard_box(spec, new.tp, t_new)
        for t in source_ts(spec, old, dst, t_new, box):
            for d in range(old.dp):
                for src_box in holdings(spec, old, t, d, "optim"):
                    b = intersect(src_box, box)
                    if b is not None:
                        moves.append(Move(i, "param", old.device(t, d), dst, b))
    return moves


def _span_view(f, kind: str, r: Region) -> torch.Tensor:
    """Region `r` of saved tensor `kind`, reading only the flat span it covers."""
    extent = 1 + sum((n - 1) * s for n, s in zip(r.size, r.stride))
    data = f.get_slice(kind)[r.offset:r.offset + extent]
    return data.as_strided(r.size, r.stride, data.storage_offset())


def read_state(shard, m: Manifest, gen: Path, layout: Layout, verify_files: bool = True) -> ShardState | None:
    """This rank's state at `layout` read from generation `gen` (new buffers; the shard is not touched)."""
    coord = layout.coord(shard.rank)
    if coord is None:
        return None
    t, d = coord
    old, specs = m.layout, shard.specs
    shape = ZeroShape.of(specs, layout.tp, layout.dp, t, d)
    st = ShardState.allocate(shape, shard.dtype, shard.device, shard.pool, torch.Generator(shard.device))
    bufs = {k: st.buffer(k) for k in KINDS}
    by_src: dict[int, list[Move]] = {}
    for mv in load_moves(old, layout, specs, shard.rank):
        by_src.setdefault(mv.src, []).append(mv)
    meta = next(mm for mm in plan_reshard(old, layout, specs).meta if mm.dst == shard.rank)
    by_src.setdefault(meta.src, [])
    try:
        for src in sorted(by_src):
            st_, sd_ = cast("tuple[int, int]", old.coord(src))  # a rank of the saved layout
            rec = m.shard(st_, sd_)
            if verify_files:
                verify_file(gen, rec)
            src_shape = ZeroShape.of(specs, old.tp, old.dp, st_, sd_)
            with safe_open(str(gen / rec.file), framework="pt", device="cpu") as f:
                for mv in by_src[src]:
                    s_reg = region(src_shape, mv.spec, "master", mv.box)  # saved tensors are in optimizer order
                    for kind in (("param",) if mv.what == "param" else OPT_KINDS):
                        d_reg = region(shape, mv.spec, kind, mv.box)
                        b = bufs[kind]
                        b.as_strided(d_reg.size, d_reg.stride, b.storage_offset() + d_reg.offset).copy_(
                            _span_view(f, kind, s_reg))
                if src == meta.src:
                    st.step, st.data_cursor = f.get_tensor("scalars").tolist()
                    if meta.keep_rng and m.device_type == shard.device.type:
                        st.rng.set_state(f.get_tensor("rng"))
                    else:  # new coordinates (or another device type's generator): the reshard RNG rule
                        st.rng.manual_seed(rng_seed(shard.seed, st.step, t, d))
    except Exception:
        st.release(None)
        raise
    return st


def _vote(ok: bool, device: torch.device, group=None) -> bool:
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def load_actor(shard, gen: str | Path, layout: Layout | None = None, verify_files: bool = True,
               ranks: tuple[int, ...] | None = None) -> Manifest:
    """Every world rank (or every rank of `ranks`: the live ones, when the world has lost some): replace the
    actor's state by generation `gen` at `layout` (default: the saved layout). Two-phase: all ranks read into new
    buffers, then vote; on any failure every rank keeps its state and raises CheckpointError (the failing rank
    its own error)."""
    gen = Path(gen)
    error: BaseException | None = None
    m: Manifest | None = None
    new_state: ShardState | None = None
    try:
        m = read_manifest(gen)
        check_model(m, shard.args, shard.specs, str(gen))
        layout = layout or m.layout
        if m.seed != shard.seed:  # the RNG rule uses the loading actor's seed from here on
            log.warning("checkpoint %s was written with seed %d, this actor has seed %d", gen, m.seed, shard.seed)
    except Exception as e:
        error = e
    if layout is not None:
        check_tp(shard.args, layout.tp)  # same answer on every rank
        shard.groups.get(layout)  # collective over the world: every rank, same point, before the vote
    voters = None if ranks is None else shard.groups.of_ranks(ranks)
    if error is None:
        try:
            new_state = read_state(shard, cast(Manifest, m), gen, cast(Layout, layout), verify_files)  # no error
        except Exception as e:
            error = e
    if not _vote(error is None, shard.device, voters):
        if new_state is not None:
            new_state.release(None)
        if error is not None:
            raise error if isinstance(error, TidalError) else CheckpointError(
                "checkpoint", str(gen), f"cannot be loaded ({type(error).__name__}: {error})",
                "resume from another generation") from error
        raise PeerCheckpointError("checkpoint", str(gen), "another rank failed to load it (this rank's state is "
                                  "unchanged)", "see that rank's error")
    shard.adopt(layout, new_state)
    return cast(Manifest, m)  # every rank read it


__all__ = ["CheckpointError", "CheckpointMeta", "Manifest", "ShardRecord", "gen_dir", "tmp_dir", "begin", "write_shard",
           "gather_records", "make_manifest", "write_manifest", "commit", "prune", "save_actor", "read_manifest",
           "verify", "verify_file", "latest", "generations", "check_model", "load_moves", "read_state",
           "load_actor"]
