"""Credentials never leave the process: wherever a config, an argv or an error value is logged, tracked, stored
or printed, a password in it is replaced by `***`.

    redact("postgresql+psycopg://tidal:s3cret@db:5432/tidal")  -> "postgresql+psycopg://tidal:***@db:5432/tidal"
    redact("http://host/api?token=abc&x=1")                       -> "http://host/api?token=***&x=1"
    redacted(cfg.model_dump(mode="json"))                        -> the same tree, every string redacted

What counts as a secret: the password of a URL's user info (`scheme://user:PASSWORD@host`) and the value of a
query or keyword parameter named like a credential (`password`, `passwd`, `pwd`, `secret`, `token`, `api_key`,
`access_key`). The user name, the host and everything else stay, so a redacted value still says where it points.
This module is the one redaction: `flatten` (MLflow params), the database's `runs.config`, `TidalError` messages,
`tidal up`'s logs and the CLI all go through it.
"""

from __future__ import annotations

import re

MASK = "***"
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/?#@]*:)(?P<secret>[^\s/?#@]+)(?=@)")
_PARAM = re.compile(r"(?P<head>(?<![A-Za-z0-9_])(?:password|passwd|pwd|secret|token|api_key|apikey|access_key)=)"
                    r"(?P<secret>[^\s&;,'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every password of a URL and every credential parameter replaced by `***`."""
    if "://" not in text and "=" not in text:
        return text
    return _PARAM.sub(rf"\g<head>{MASK}", _USERINFO.sub(rf"\g<head>{MASK}", text))


def redacted(value: object) -> object:
    """`value` (a JSON-like tree: dicts, lists, tuples, strings, numbers) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(v) for v in value)
    return value
