"""Credentials never leave the process: wherever a config, an argv or an error value is logged, tracked, stored
or printed, a password in it is replaced by `***`.

    redact("postgresql+psycopg://tidal:s3cret@db:5432/tidal")  -> "postgresql+psycopg://tidal:***@db:5432/tidal"
    redact("http://host/api?token=abc&x=1")                       -> "http://host/api?token=***&x=1"
    redacted(cfg.model_dump(mode="json"))                        -> the same tree, every string redacted

What counts as a secret: the password of a URL's user info (`scheme://user:PASSWORD@host`, found by splitting the
URL into its parts, whatever number of slashes follows the scheme) and the value of a
query or keyword parameter named like a credential (`password`, `passwd`, `pwd`, `secret`, `token`, `api_key`,
`access_key`). The user name, the host and everything else stay, so a redacted value still says where it points.
This module is the one redaction: `flatten` (MLflow params), the database's `runs.config`, `TidalError` messages,
`tidal up`'s logs and the CLI all go through it.
"""

from __future__ import annotations

import re

MASK = "***"
# A URL's scheme (RFC 3986: a letter, then letters, digits, + . -), then any number of slashes: a path library
# collapses `https://` to `https:/`, and the password must be masked in both spellings.
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:/*")
_TOKEN = re.compile(r"[^\s'\"<>()\[\]{},]+")
_PARAM = re.compile(r"(?P<head>(?<![A-Za-z0-9_])(?:password|passwd|pwd|secret|token|api_key|apikey|access_key)=)"
                    r"(?P<secret>[^\s&;,'\"]+)", re.IGNORECASE)


def _mask_userinfo(token: str) -> str:
    """`token` with the password of every URL in it masked. A URL's authority runs from after `scheme:` and its
    slashes to the first `/ ? #`; its user info is what precedes the authority's last `@`, and the password is
    the user info after its first `:`."""
    out, pos = [], 0
    for m in _SCHEME.finditer(token):
        if m.start() < pos or (m.start() > 0 and token[m.start() - 1].isalnum()):
            continue   # inside a URL already handled, or a scheme glued to a word: not where a URL starts
        start = m.end()
        end = next((i for i in range(start, len(token)) if token[i] in "/?#"), len(token))
        at = token.rfind("@", start, end)
        colon = token.find(":", start, at) if at > 0 else -1
        if colon < 0:
            continue
        out.append(token[pos:colon + 1] + MASK)
        pos = at
    return "".join(out) + token[pos:]


def redact(text: str) -> str:
    """`text` with every password of a URL and every credential parameter replaced by `***`."""
    if "@" not in text and "=" not in text:
        return text
    if "@" in text:
        text = _TOKEN.sub(lambda m: _mask_userinfo(m.group()) if "@" in m.group() else m.group(), text)
    return _PARAM.sub(rf"\g<head>{MASK}", text)


def redacted(value: object) -> object:
    """`value` (a JSON-like tree: dicts, lists, tuples, strings, numbers) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(v) for v in value)
    return value
