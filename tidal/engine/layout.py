"""Actor layouts and the shard arithmetic every other engine module shares.

A layout is `(tp, dp, devices)`: `tp * dp` ranks, each a device id. The rank of tensor-parallel index `t` and
data-parallel index `d` is `devices[d * tp + t]` (TP ranks adjacent, as Megatron orders them)::

    Layout(tp=2, dp=3, devices=(0,1,2,3,4,5))
        d=0: (t=0 -> dev 0, t=1 -> dev 1)    TP groups: (0,1) (2,3) (4,5)
        d=1: (t=0 -> dev 2, t=1 -> dev 3)    DP groups: (0,2,4) (1,3,5)
        d=2: (t=0 -> dev 4, t=1 -> dev 5)

Splits are "floor" splits so any size works (uneven DP such as 3, 5, 7; vocab not divisible by TP):
part `i` of `n` items over `k` parts is `[n*i//k, n*(i+1)//k)`.

Ownership of one parameter of global shape S with TP dim `tp_dim` on rank (t, d):
- model weights: the TP shard `split(S[tp_dim], tp, t)` along `tp_dim` (the whole tensor if `tp_dim is None`),
  replicated over DP;
- optimizer state (fp32 master, Adam moments): the flat range `split(numel(tp shard), dp, d)` of the row-major
  flattened TP shard (ZeRO-1, per parameter, so any DP size is valid).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tidal.core.errors import LayoutError
from tidal.core.placement import format_ids, parse_device_ids


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Floor split: the half-open range of part `i` when `n` items go into `parts` parts."""
    assert 0 <= i < parts, (i, parts)
    return n * i // parts, n * (i + 1) // parts


@dataclass(frozen=True)
class Layout:
    """Where the actor lives: TP size, DP size, and the device id of every rank (TP-major within a DP group)."""

    tp: int
    dp: int
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise LayoutError("layout", (self.tp, self.dp), "tp and dp must be >= 1", "e.g. tp=1,dp=2")
        if len(self.devices) != self.tp * self.dp:
            raise LayoutError("layout.devices", format_ids(self.devices),
                              f"{len(self.devices)} devices for tp*dp={self.tp * self.dp} ranks",
                              f"give exactly {self.tp * self.dp} device ids")
        if len(set(self.devices)) != len(self.devices):
            raise LayoutError("layout.devices", self.devices, "lists a device twice", "list each id once")

    @property
    def size(self) -> int:
        return self.tp * self.dp

    def device(self, t: int, d: int) -> int:
        return self.devices[d * self.tp + t]

    def coord(self, device: int) -> tuple[int, int] | None:
        """(t, d) of `device`, or None if it is not in this layout."""
        try:
            i = self.devices.index(device)
        except ValueError:
            return None
        return i % self.tp, i // self.tp

    def tp_group(self, d: int) -> tuple[int, ...]:
        return self.devices[d * self.tp:(d + 1) * self.tp]

    def dp_group(self, t: int) -> tuple[int, ...]:
        return tuple(self.device(t, d) for d in range(self.dp))

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp},devices={format_ids(self.devices)}"

    @staticmethod
    def parse(text: str, field: str = "layout") -> Layout:
        """`"tp=2,dp=2"` (devices 0..3) or `"tp=2,dp=2,devices=4-7"`."""
        head, sep, dev = text.partition("devices=")
        kv: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in head.split(","))):
            k, eq, v = part.partition("=")
            if not eq or k not in ("tp", "dp"):
                raise LayoutError(field, text, f"cannot read {part!r}", 'write "tp=A,dp=B[,devices=0-3]"')
            try:
                kv[k] = int(v)
            except ValueError:
                raise LayoutError(field, text, f"{k} is not an integer", 'e.g. "tp=2,dp=2"') from None
        tp, dp = kv.get("tp", 1), kv.get("dp", 1)
        devices = parse_device_ids(dev, f"{field}.devices") if sep else tuple(range(tp * dp))
        return Layout(tp, dp, tuple(devices))


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: name, global shape, and the dim TP splits (None: replicated over TP)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def tp_range(self, tp: int, t: int) -> tuple[int, int]:
        """Range of the global `tp_dim` held by TP rank t (whole dim 0 when replicated)."""
        if self.tp_dim is None:
            return 0, self.shape[0] if self.shape else 1
        return split(self.shape[self.tp_dim], tp, t)

    def tp_shape(self, tp: int, t: int) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        lo, hi = self.tp_range(tp, t)
        s = list(self.shape)
        s[self.tp_dim] = hi - lo
        return tuple(s)

    def tp_slices(self, tp: int, t: int) -> tuple[slice, ...]:
        """Index of the TP shard within the global tensor."""
        if self.tp_dim is None:
            return tuple(slice(None) for _ in self.shape)
        lo, hi = self.tp_range(tp, t)
        return tuple(slice(lo, hi) if i == self.tp_dim else slice(None) for i in range(len(self.shape)))

    def zero_range(self, layout: Layout, t: int, d: int) -> tuple[int, int]:
        """Flat range of the row-major TP shard whose optimizer state DP rank d owns."""
        return split(prod(self.tp_shape(layout.tp, t)), layout.dp, d)


def synced_layout(current: Layout, new: Layout | None, holds_state: bool, rank: int) -> Layout:
    """The layout a rank that sat out member-local reshards moves to (`sync_layout` of every actor backend): it
    holds no state, so nothing moves; a rank that holds shards of `current` cannot jump to another layout."""
    if new is None or new == current:
        return current
    if holds_state:
        raise LayoutError("layout", str(new), f"rank {rank} holds shards of {current}, not of {new}",
                          "pass the layout this rank's last reshard moved it to")
    return new
