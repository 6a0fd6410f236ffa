"""`${...}` in RLinf configs, resolved by OmegaConf (Hydra's config library) with RLinf's resolvers registered.

The file is read with `yaml.safe_load` (our safety rule: no tags, no OmegaConf YAML loader), the mapping is given to
`OmegaConf.create` and resolved there: `${a.b}`, `${a.b[0]}`, relative `${.x}` / `${..x}`, `${oc.env:VAR,default}`,
`${oc.select:key,default}`, `${oc.decode:text}`, nesting, `\\${` escapes, a whole-string reference keeping its
type. On top of OmegaConf's own `oc.*` resolvers, the ones RLinf registers (rlinf/utils/omega_resolver.py):
`${subtract:x,y}`, `${multiply:x,y}`, `${int_div:x,y}`, `${not:x}`. RLinf's `torch.dtype`, `json_load`,
`project_path` (and Hydra's `now`, `hydra`, ...) are not evaluated.

OmegaConf's exceptions become `ConfigError`s naming the file and dotted key (`exp.yaml: runner.logger.log_path`),
the offending interpolation as the value (the innermost `${...}` of the string that fails on its own) and the
cause; for a cycle the chain of keys (`a -> b -> c -> a`), which OmegaConf does not report.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, cast

from omegaconf import Container, OmegaConf
from omegaconf.errors import (
    GrammarParseError,
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
)
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse

from tidal.core.errors import ConfigError

# ------------------------------------------------------------------------------------------------- resolvers


def _numbers(name: str, args: tuple) -> tuple:
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise ValueError(f"{name} needs two numbers, ${{{name}:x,y}} (got {list(args)!r})")
    return args


def _subtract(*args: Any) -> Any:
    x, y = _numbers("subtract", args)
    return x - y


def _multiply(*args: Any) -> Any:
    x, y = _numbers("multiply", args)
    return x * y


def _int_div(*args: Any) -> Any:
    x, y = _numbers("int_div", args)
    if y == 0:
        raise ValueError("int_div divides by zero")
    return x // y


def _not(*args: Any) -> bool:
    if len(args) != 1:
        raise ValueError(f"not takes one argument, ${{not:x}} (got {list(args)!r})")
    return not bool(args[0])


#: RLinf's resolvers (same names and results; the argument checks are ours, for a clearer message).
RLINF_RESOLVERS = {"subtract": _subtract, "multiply": _multiply, "int_div": _int_div, "not": _not}
SUPPORTED_RESOLVERS = ("oc.env", "oc.select", "oc.decode", *RLINF_RESOLVERS)

# OmegaConf 2.4 renamed register_new_resolver to register_resolver (the old name warns); in 2.3 register_resolver
# is the legacy string-only API, without `replace`.
_REGISTER = (OmegaConf.register_resolver if "replace" in inspect.signature(OmegaConf.register_resolver).parameters
             else OmegaConf.register_new_resolver)


def register_resolvers() -> None:
    """Register RLinf's resolvers with OmegaConf (process-wide). `replace=True`: calling it again is harmless."""
    for name, fn in RLINF_RESOLVERS.items():
        _REGISTER(name, fn, replace=True)


# --------------------------------------------------------------------------------------------------- resolving


class Unresolved:
    """A leaf whose interpolation failed; `convert` raises `error` only if Tidal needs the value."""

    def __init__(self, error: ConfigError):
        self.error = error

    def __repr__(self) -> str:
        return f"<unresolved: {self.error.problem}>"


def dotted(path: tuple) -> str:
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            out += f".{seg}" if out else str(seg)
    return out or "<root>"


def _not_a_mapping(doc: Any, field: str) -> ConfigError:
    return ConfigError(field, type(doc).__name__, "top level must be a mapping of sections",
                       "pass an RLinf experiment YAML (cluster:, runner:, algorithm: ... sections)")


def resolve_interpolations(doc: dict, field: str = "rlinf config") -> dict:
    """`doc` with every `${...}` resolved (see the module doc). Raises ConfigError naming the reference."""
    if not isinstance(doc, dict):
        raise _not_a_mapping(doc, field)
    tree = _Tree(doc, field)
    if tree.invalid:
        raise next(iter(tree.invalid.values()))
    try:
        return cast(dict, OmegaConf.to_container(tree.cfg, resolve=True))  # a DictConfig's container is a dict
    except OmegaConfBaseException as err:
        tree.value(())          # leaf by leaf: raises the ConfigError naming the first leaf that fails
        raise ConfigError(f"{field}: {getattr(err, 'full_key', None) or '<root>'}", None,
                          f"cannot be resolved ({_detail(err)})", "fix the interpolation") from None


def resolve_lenient(doc: dict, field: str) -> dict:
    """Like resolve_interpolations, but a failing leaf (a list counts as one) becomes an `Unresolved`."""
    if not isinstance(doc, dict):
        raise _not_a_mapping(doc, field)
    tree = _Tree(doc, field)

    def walk(node: dict, path: tuple) -> dict:
        out: dict[Any, Any] = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v, path + (k,))
                continue
            try:
                out[k] = tree.value(path + (k,))
            except ConfigError as e:
                out[k] = Unresolved(e)
        return out

    return walk(doc, ())


class _Tree:
    """The raw mapping and its OmegaConf config, resolved per key so that an error names the key."""

    def __init__(self, doc: dict, field: str):
        register_resolvers()
        self.doc, self.field = doc, field
        # OmegaConf refuses the whole config for one string its grammar cannot parse: such a value is an error of
        # its own key (listed here), and OmegaConf gets '???' (not given) in its place.
        self.invalid: dict[tuple, ConfigError] = {}
        try:
            # allow_objects: yaml.safe_load may give dates, which OmegaConf would refuse as values
            self.cfg = OmegaConf.create(self.screen(doc, ()), flags={"allow_objects": True})
        except OmegaConfBaseException as err:
            where = f"{field}: {err.full_key}" if getattr(err, "full_key", None) else field
            raise ConfigError(where, type(doc).__name__, f"cannot be read as an OmegaConf config ({_detail(err)})",
                              "use text, number or boolean keys and plain YAML values") from None

    def screen(self, node: Any, path: tuple) -> Any:
        if isinstance(node, dict):
            return {k: self.screen(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.screen(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            try:
                parse(node)
            except GrammarParseError as err:
                self.invalid[path] = ConfigError(
                    f"{self.field}: {dotted(path)}", node, f"is not a valid interpolation ({_detail(err)})",
                    "write interpolations as ${a.b} or ${resolver:arg,...}; escape a literal as \\${")
                return "???"
        return node

    def raw(self, path: tuple) -> Any:
        node: Any = self.doc
        for seg in path:
            node = node[seg]
        return node

    def node(self, path: tuple) -> Any:
        node: Any = self.cfg
        for seg in path:
            node = node[seg]
        return node

    def value(self, path: tuple) -> Any:
        if path in self.invalid:
            raise self.invalid[path]
        raw = self.raw(path)
        if isinstance(raw, dict):
            return {k: self.value(path + (k,)) for k in raw}
        if isinstance(raw, list):
            return [self.value(path + (i,)) for i in range(len(raw))]
        if not (isinstance(raw, str) and "${" in raw):
            return raw
        parent = self.node(path[:-1])
        try:
            return _plain(parent[path[-1]])
        except OmegaConfBaseException as err:
            raise self.error(path, raw, err) from None

    # -- errors

    def error(self, path: tuple, raw: Any, err: OmegaConfBaseException) -> ConfigError:
        where, detail = f"{self.field}: {dotted(path)}", _detail(err)
        text, resolver = self.offender(path, raw)
        if isinstance(err, UnsupportedInterpolationType):
            what = f"resolver {resolver!r}" if resolver else f"a resolver ({detail})"
            return ConfigError(where, text, f"uses {what}, which the converter does not evaluate (supported: "
                                            f"{', '.join(SUPPORTED_RESOLVERS)})",
                               "replace this interpolation with its value")
        if isinstance(err, InterpolationKeyError):
            return ConfigError(where, text, f"references a key that is not set ({detail})",
                               "define that key, or replace the reference with a value")
        if isinstance(err, InterpolationToMissingValueError):
            return ConfigError(where, text, f"references a key whose value is '???' (mandatory, not given): {detail}",
                               "give that key a value")
        chain = self.cycle(path) if isinstance(err, InterpolationResolutionError) else None
        if chain:
            return ConfigError(where, text, f"is part of an interpolation cycle: {chain}",
                               "break the cycle: give one of these keys a plain value")
        fix = ("export the variable, or give a default: ${oc.env:VAR,default}" if resolver == "oc.env"
               else "fix the interpolation, or replace it with its value")
        return ConfigError(where, text, f"cannot be resolved ({detail})", fix)

    def offender(self, path: tuple, raw: str) -> tuple[str, str | None]:
        """The innermost `${...}` of `raw` that fails on its own, tried at `path`'s place (so relative references
        mean the same), and its resolver name; the whole string when none does."""
        parent = self.node(path[:-1])
        for start, stop, resolver in _interpolations(raw):
            text = raw[start:stop]
            if OmegaConf.is_list(parent):
                parent.append(text)
                where: Any = len(parent) - 1
            else:
                where = "__tidal_probe__"
                parent[where] = text
            try:
                _plain(parent[where])
            except OmegaConfBaseException:
                return text, resolver
            finally:
                del parent[where]
        return raw, None

    def cycle(self, start: tuple) -> str | None:
        """`a -> b -> c -> a` when the plain references of the raw values lead from `start` back to a key on the
        way (a mapping leads to its keys); None when they do not."""
        stack: list[tuple] = []
        done: set[tuple] = set()

        def visit(path: tuple) -> list[tuple] | None:
            if path in stack:
                return stack[stack.index(path):] + [path]
            if path in done:
                return None
            stack.append(path)
            for nxt in self.references(path):
                found = visit(nxt)
                if found:
                    return found
            stack.pop()
            done.add(path)
            return None

        chain = visit(start)
        return " -> ".join(dotted(p) for p in chain) if chain else None

    def references(self, path: tuple) -> list[tuple]:
        raw = self.raw(path)
        if isinstance(raw, dict):
            return [path + (k,) for k in raw]
        if isinstance(raw, list):
            return [path + (i,) for i in range(len(raw))]
        if not (isinstance(raw, str) and "${" in raw):
            return []
        out = []
        for start, stop, resolver in _interpolations(raw):
            key = raw[start + 2:stop - 1].strip()
            if resolver is None and "${" not in key:
                target = self.locate(key, path)
                if target is not None:
                    out.append(target)
        return out

    def locate(self, key: str, holder: tuple) -> tuple | None:
        """The raw path a plain reference `key` written at `holder` points into (as far as the raw mapping goes:
        a key under an interpolated value stops at that value)."""
        dots = len(key) - len(key.lstrip("."))
        segs: list[Any] = [s for s in re.split(r"[.\[\]]", key[dots:]) if s]
        if dots:
            base = list(holder[:-1])
            if dots - 1 > len(base):
                return None
            segs = base[:len(base) - (dots - 1)] + segs
        node: Any = self.doc
        out: list[Any] = []
        for seg in segs:
            if isinstance(node, dict):
                k = seg if seg in node else int(seg) if str(seg).isdigit() and int(seg) in node else None
            elif isinstance(node, list):
                k = int(seg) if re.fullmatch(r"-?\d+", str(seg)) and -len(node) <= int(seg) < len(node) else None
                k = k % len(node) if k is not None else None
            else:
                break
            if k is None:
                return None
            out.append(k)
            node = node[k]
        return tuple(out)


def _interpolations(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, resolver name or None) of every `${...}` in `text`, innermost first, from OmegaConf's grammar."""
    try:
        tree = parse(text)
    except GrammarParseError:
        return []
    found: list[tuple[int, int, str | None]] = []

    def walk(ctx: Any) -> None:
        for child in getattr(ctx, "children", None) or ():
            walk(child)
        if isinstance(ctx, OmegaConfGrammarParser.InterpolationNodeContext):
            found.append((ctx.start.start, ctx.stop.stop + 1, None))
        elif isinstance(ctx, OmegaConfGrammarParser.InterpolationResolverContext):
            found.append((ctx.start.start, ctx.stop.stop + 1, ctx.resolverName().getText()))

    walk(tree)
    return found


def _plain(value: Any) -> Any:
    """A resolved value as plain Python (a mapping or list that a reference selected, resolved in turn)."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def _detail(err: Exception) -> str:
    """OmegaConf's message without the `full_key:` / `object_type=` lines it appends."""
    lines = str(err).strip().splitlines()
    return lines[0].strip() if lines else type(err).__name__
