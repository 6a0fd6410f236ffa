"""A character-level tokenizer that ships in the repo, saved in the Hugging Face `tokenizer.json` shape.

Every character of the task alphabet is one token; three special tokens come first:

    id:     0      1      2     3   4  ...  12  13  14  15  16  17  18
    token:  <pad>  <bos>  <eos> 0   1  ...  9   +   *   ,   =   :   ' '

A prompt is `[<bos>] + encode(prompt_text)`; a response is `encode(answer) + [<eos>]`. `encode` adds no
special tokens unless asked (`add_bos`, `add_eos`), like Hugging Face's `add_special_tokens=False`.
`decode` renders special tokens as their text (`"<eos>"`) unless `skip_special_tokens=True`: the reward
verifier (`tidal/engine/rl_tasks.py`) looks for the literal `<eos>`, so decode responses with the default.

Saved form (`save(dir)` writes `dir/tokenizer.json`) is the `tokenizers` library's JSON: a WordLevel model
whose vocab is the characters, a `Split` pre-tokenizer on the regex `.` (each character is one piece), a
`Fuse` decoder (pieces join without spaces) and the specials as `added_tokens`. A checkpoint directory
therefore carries its tokenizer. Checked with tokenizers 0.23.2 and transformers 5.17:
`tokenizers.Tokenizer.from_file` and `PreTrainedTokenizerFast(tokenizer_file=...)` give the same ids and
the same decoded text as this class (space included), and refuse an unknown character.
`load` accepts only files of that shape where every non-special token is a single character.

A model and a tokenizer agree when the model's vocab size equals `vocab_size` (`check_compatible`); a
larger, padded embedding is refused too, because sampling could then produce ids that decode to nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tidal.core.errors import TidalError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
# The characters of every built-in task (see tidal/engine/rl_tasks.py): digits, operators, separators, space.
DEFAULT_CHARS = "0123456789+*,=: "
TOKENIZER_FILE = "tokenizer.json"
# The key of `unk_token` in the WordLevel model. It is deliberately not in the vocab: an unknown character
# is an error both here and in Hugging Face's loader, never a silent <unk>.
_UNK = "<unk>"


class CharTokenizer:
    """Specials `<pad> <bos> <eos>` (ids 0, 1, 2), then one token per character of `chars`, in order."""

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            dup = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"tokenizer chars must be distinct; repeated: {dup!r}")
        if not chars:
            raise ValueError("tokenizer chars must not be empty")
        self.chars = chars
        self._id_of = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._tokens: tuple[str, ...] = SPECIAL_TOKENS + tuple(chars)

    # ---- ids --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def token(self, token_id: int) -> str:
        """The text of one id (specials as `<eos>` etc.)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocab [0, {self.vocab_size})")
        return self._tokens[token_id]

    # ---- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """One id per character. Special-token text (`"<eos>"`) inside `text` is NOT parsed: `<` is not
        a character of the vocab, so it raises, like any character outside the vocab."""
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            tid = self._id_of.get(ch)
            if tid is None:
                raise ValueError(f"character {ch!r} at position {pos} of {text!r} is not in the tokenizer's "
                                 f"alphabet {self.chars!r}; build the tokenizer with chars that include it")
            ids.append(tid)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Concatenated token texts; specials appear as `<pad>`, `<bos>`, `<eos>` unless skipped."""
        out = []
        for tid in ids:
            tid = int(tid)
            if skip_special_tokens and tid in self.special_ids:
                continue
            out.append(self.token(tid))
        return "".join(out)

    # ---- persistence ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The `tokenizer.json` document (Hugging Face `tokenizers` schema, version 1.0)."""
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated",
                              "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(self._tokens)},
                      "unk_token": _UNK},
        }

    def save(self, path: str | Path) -> Path:
        """Write `tokenizer.json` into directory `path` (created), or to `path` itself if it ends in .json."""
        path = Path(path)
        target = path if path.suffix == ".json" else path / TOKENIZER_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return target

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        """Read a `tokenizer.json` written by `save` (a directory holding one, or the file itself)."""
        path = Path(path)
        target = path / TOKENIZER_FILE if path.is_dir() else path
        if not target.is_file():
            raise TidalError("tokenizer", str(path), f"no {TOKENIZER_FILE} there",
                             "point at a checkpoint directory written by Tidal or at a tokenizer.json file")
        try:
            doc = json.loads(target.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TidalError("tokenizer", str(target), f"is not valid JSON ({exc})",
                             "restore the file from the checkpoint it came with") from exc
        return cls.from_json(doc, source=str(target))

    @classmethod
    def from_json(cls, doc: dict, source: str = "<dict>") -> CharTokenizer:
        def bad(problem: str) -> TidalError:
            return TidalError("tokenizer", source, problem,
                              "use a character-level WordLevel tokenizer.json as written by CharTokenizer.save")

        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, dict) or model.get("type") != "WordLevel":
            raise bad("model.type is not WordLevel")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            raise bad("model.vocab is missing or empty")
        by_id = sorted((int(i), t) for t, i in vocab.items())
        if [i for i, _ in by_id] != list(range(len(by_id))):
            raise bad("vocab ids are not 0..N-1 without gaps")
        tokens = [t for _, t in by_id]
        if tuple(tokens[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise bad(f"the first ids must be {list(SPECIAL_TOKENS)}, found {tokens[:len(SPECIAL_TOKENS)]}")
        chars = tokens[len(SPECIAL_TOKENS):]
        multi = [t for t in chars if len(t) != 1]
        if multi:
            raise bad(f"tokens {multi[:5]} are not single characters")
        return cls("".join(chars))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(self.chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self.chars!r}, vocab_size={self.vocab_size})"


def default_tokenizer() -> CharTokenizer:
    """The tokenizer of every built-in task."""
    return CharTokenizer(DEFAULT_CHARS)


def check_compatible(tokenizer: CharTokenizer, vocab_size: int, source: str | None = None) -> None:
    """Raise `TidalError` unless a model with `vocab_size` embeddings matches `tokenizer` exactly."""
    if vocab_size != tokenizer.vocab_size:
        where = f" loaded from {source}" if source else ""
        raise TidalError("model.vocab_size", vocab_size,
                         f"does not match the tokenizer{where}, which has {tokenizer.vocab_size} tokens",
                         "load the tokenizer saved with this checkpoint, or set model.vocab_size to "
                         f"{tokenizer.vocab_size} (or leave it unset to take the tokenizer's size)")

