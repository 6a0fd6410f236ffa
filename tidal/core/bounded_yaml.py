"""YAML whose cost is bounded before it is built: every config, override value and sweep space goes through here.

    doc = load_yaml(text, "config")       # yaml.SafeLoader's document, or ConfigError naming `field`

`yaml.safe_load` refuses tags, but a 340-byte document of nested aliases (`a: &a [x, x]`, `b: &b [*a, *a]`, ...)
still means billions of values once anything walks it, and deep nesting overflows the stack. So the text is
size-limited, then composed into YAML's node graph (linear in the text: an alias is one shared node), and that
graph is measured as the tree it stands for (aliases expanded, counted once per use, memoized per node) before
a single Python value is constructed. Limits, each an error naming the field and the limit:
- MAX_TEXT_BYTES of text (MAX_VALUE_BYTES for one `key=value` override);
- MAX_NODES values in the expanded tree (a real config has a few hundred);
- MAX_DEPTH levels of nesting (a real config has four).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tidal.core.errors import ConfigError

MAX_TEXT_BYTES = 256 << 10   # composing YAML in Python costs ~60 µs a value: 256 KiB stays within ~2 s
MAX_VALUE_BYTES = 64 << 10
MAX_NODES = 100_000
MAX_DEPTH = 32


def _expanded_size(root: yaml.Node, field: str) -> int:
    """Values in the tree `root` stands for, aliases expanded; ConfigError past MAX_NODES or MAX_DEPTH."""
    sizes: dict[int, int] = {}
    # iterative post-order walk: (node, depth, children done?)
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    on_path: set[int] = set()
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_NODES:
                raise ConfigError(field, f"{total:,}+ values", f"expands to more than {MAX_NODES:,} values "
                                  "(aliases count once per use)",
                                  "write a smaller document; a config has a few hundred values")
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(field, f"depth {depth}", f"nests deeper than {MAX_DEPTH} levels",
                              "flatten the structure; a config has sections of plain keys")
        if key in on_path:   # SafeLoader cannot build a recursive document, but never loop on one
            raise ConfigError(field, "recursive alias", "refers to itself", "remove the self-referencing alias")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def read_text(path: Path, field: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the file at `path`, refused by its size before a byte is read."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ConfigError(field, f"{size:,} bytes", f"is larger than {max_bytes:,} bytes",
                          "a config is a few KB: pass a smaller file")
    return path.read_text(encoding="utf-8")


def load_yaml(text: str, field: str, max_bytes: int = MAX_TEXT_BYTES) -> object:
    """The document of `text` (SafeLoader: no tags, no code), within the limits above; `yaml.YAMLError` for bad
    syntax (the caller names the position), ConfigError naming `field` past a limit."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ConfigError(field, f"{size:,} bytes", f"is larger than {max_bytes:,} bytes",
                          "a config is a few KB: pass a smaller file or value")
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(field, "deep nesting", f"nests deeper than {MAX_DEPTH} levels",
                              "flatten the structure; a config has sections of plain keys") from None
        if node is None:
            return None
        _expanded_size(node, field)
        return loader.construct_document(node)
    finally:
        loader.dispose()
