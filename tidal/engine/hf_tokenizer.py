"""Tokenizers behind one interface: a checkpoint's own (Hugging Face) and the character tokenizer of the tiny tasks.

    Tokenizer            what the pipeline needs of a tokenizer
      vocab_size         ids it can produce (<= the model's embedding rows: Qwen pads 151,665 tokens to 151,936)
      pad_id             a real token of the vocab (never fed to attention: masks cover it)
      stop_ids           ids that end a response (several: eos of the tokenizer and of generation_config.json)
      prompt_ids(p)      a prompt (text, or chat messages) as the model sees it
      response_text(ids) the text a verifier reads

`HFTokenizer` loads the tokenizer files of `model.path` through `transformers.AutoTokenizer` with local files
only. With a chat template (`data.apply_chat_template`, default: on when the tokenizer has one) a text prompt is
rendered as one user message with the generation prompt, a list of messages as given; `chat_template_kwargs`
(e.g. Qwen3's `enable_thinking: false`) are passed to the template, so the rendering is a pure function of the
prompt. Rendered text is encoded without adding special tokens again (the template writes any BOS itself); a
plain prompt is encoded with the tokenizer's own special-token rule (Llama adds BOS, Qwen adds nothing), so no
BOS is assumed. Responses decode without special tokens.

`TokenizerSpec` is the picklable description a worker rebuilds its tokenizer from (sent once per run).

`train_bpe_tokenizer` makes a byte-level BPE tokenizer (the `tokenizers` library, digits split one per token as
Llama and Qwen split them) with a chat template and saves it as a Hugging Face tokenizer directory: the tiny
main job's model is then a real HF checkpoint with a real tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tidal.core.errors import TidalError
from tidal.engine.datasets import Prompt
from tidal.engine.tokenizer import CharTokenizer


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    def prompt_ids(self, prompt: Prompt) -> list[int]: ...
    def response_text(self, ids: Sequence[int]) -> str: ...


def _stop_ids_of(path: Path, tok) -> tuple[int, ...]:
    """eos ids of generation_config.json (int or list) then the tokenizer's eos, in order, once each."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TidalError("model.path", str(gen), f"is not valid JSON ({err})", "restore the file") from None
        ids += [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return tuple(dict.fromkeys(ids))


#: files of which a Hugging Face tokenizer directory has at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
                   "tokenizer_config.json")


class HFTokenizer:
    """A checkpoint directory's tokenizer (see module doc)."""

    def __init__(self, path: str | Path, apply_chat_template: bool | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        from transformers import AutoTokenizer

        self.path = Path(path)
        # transformers builds an empty tokenizer for a folder without tokenizer files: refuse that here
        if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
            raise TidalError("model.path", str(path), f"holds no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                             "save the tokenizer into the checkpoint directory (tokenizer.save_pretrained(dir))")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TidalError("model.path", str(path), f"holds no tokenizer transformers can load ({err})",
                             "save the tokenizer into the checkpoint directory (tokenizer.save_pretrained(dir))") \
                from None
        has_template = bool(getattr(self.hf, "chat_template", None))
        if apply_chat_template and not has_template:
            raise TidalError("data.apply_chat_template", True, f"the tokenizer in {path} has no chat template",
                             "set data.apply_chat_template: false to encode prompts as plain text, or add a "
                             "chat_template to the tokenizer")
        self.chat = has_template if apply_chat_template is None else apply_chat_template
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._stop = _stop_ids_of(self.path, self.hf)
        if not self._stop:
            raise TidalError("model.path", str(path), "names no end-of-sequence token (tokenizer eos_token or "
                             "generation_config.json eos_token_id)", "add eos_token_id to generation_config.json")
        pad = self.hf.pad_token_id
        self._pad = int(pad) if pad is not None else self._stop[0]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render(self, prompt: Prompt) -> str:
        """The prompt's text as the model sees it (after the chat template when on)."""
        if not self.chat:
            if not isinstance(prompt, str):
                raise TidalError("data.apply_chat_template", False, "chat-message prompts need the chat template",
                                 "set data.apply_chat_template: true (the tokenizer must have a template)")
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [{"role": r, "content": c} for r, c in prompt]
        try:
            return cast(str, self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                         **self.template_kwargs))  # tokenize=False: text
        except Exception as err:  # noqa: BLE001 - jinja errors of a user's template: name them
            raise TidalError("data.chat_template_kwargs", self.template_kwargs,
                             f"the chat template failed to render ({type(err).__name__}: {err})",
                             "fix the template arguments, or set data.apply_chat_template: false") from None

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        text = self.render(prompt)
        return list(self.hf.encode(text, add_special_tokens=not self.chat))

    def response_text(self, ids: Sequence[int]) -> str:
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=True))  # one sequence: one text

    def save_pretrained(self, path: str) -> None:
        self.hf.save_pretrained(path)


class CharPromptTokenizer:
    """The built-in tasks' `CharTokenizer` behind the `Tokenizer` interface: `<bos>` + prompt characters, and
    responses decoded with their specials (the task verifier looks for the literal `<eos>`)."""

    def __init__(self, chars: str):
        self.char = CharTokenizer(chars)

    vocab_size = property(lambda self: self.char.vocab_size)
    pad_id = property(lambda self: self.char.pad_id)
    stop_ids = property(lambda self: (self.char.eos_id,))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        assert isinstance(prompt, str), "built-in tasks have text prompts"
        return self.char.encode(prompt, add_bos=True)

    def response_text(self, ids: Sequence[int]) -> str:
        return self.char.decode(ids)

    def encode(self, text: str) -> list[int]:
        return self.char.encode(text)


@dataclass(frozen=True)
class TokenizerSpec:
    """How a worker rebuilds the run's tokenizer: `char` (the built-in tasks') or `hf` (a checkpoint's)."""

    kind: str
    chars: str = ""
    path: str = ""
    apply_chat_template: bool | None = None
    chat_template_kwargs: str = "{}"   # JSON: the spec stays hashable and plain

    def build(self) -> Tokenizer:
        if self.kind == "char":
            return CharPromptTokenizer(self.chars)
        return HFTokenizer(self.path, self.apply_chat_template, json.loads(self.chat_template_kwargs))


#: a ChatML template (as Qwen's), the one `train_bpe_tokenizer` writes
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
    "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 256,
                        chat_template: str = CHATML_TEMPLATE) -> Path:
    """Train a byte-level BPE tokenizer on `texts` (digits one per token) and save it as an HF tokenizer with
    specials `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) and `chat_template`."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(list(texts), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out
