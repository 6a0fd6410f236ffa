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

Before a directory's tokenizer is trusted, it is checked as a run would meet it: each tokenizer file present is
a regular file inside the directory (`hf_checkpoint.checkpoint_file`), a vocabulary is among them (`VOCAB_FILES`:
without one transformers builds a tokenizer of special tokens only, and every prompt becomes one token), an
ordinary sentence encodes to several tokens, and the chat template renders a one-line conversation in a forked
child within `TEMPLATE_SECONDS`, `TEMPLATE_MAX_CHARS` and `TEMPLATE_EXTRA_MEMORY` (`render_bounded`), so a
template that loops or explodes is an error naming `data.apply_chat_template` instead of a hang.

`TokenizerSpec` is the picklable description a worker rebuilds its tokenizer from (sent once per run).

`train_bpe_tokenizer` makes a byte-level BPE tokenizer (the `tokenizers` library, digits split one per token as
Llama and Qwen split them) with a chat template and saves it as a Hugging Face tokenizer directory: the tiny
main job's model is then a real HF checkpoint with a real tokenizer.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol, cast

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tidal.core.errors import TidalError
from tidal.engine.datasets import Prompt
from tidal.engine.hf_checkpoint import checkpoint_file, read_checkpoint_json
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
    if checkpoint_file(path, "generation_config.json") is not None:
        eos = read_checkpoint_json(path, "generation_config.json").get("eos_token_id")
        listed = eos if isinstance(eos, list) else [eos]
        ids += [i for i in listed if isinstance(i, int) and not isinstance(i, bool)]
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return tuple(dict.fromkeys(ids))


#: files of a Hugging Face tokenizer directory that `AutoTokenizer` may read; each present one must pass
#: `checkpoint_file` (a regular file inside the directory)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "config.json")
#: the vocabulary: a tokenizer directory holds one of these sets complete. tokenizer_config.json alone names a
#: class but no vocabulary, and transformers then builds a tokenizer of the special tokens only, which encodes
#: every prompt as one token or none
VOCAB_FILES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("vocab.json", "merges.txt"),
               ("vocab.txt",))
#: an ordinary sentence: any real tokenizer encodes it as several tokens
SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog, 12 times in 3.5 seconds."
#: the conversation the chat template is rendered on once, bounded, when the tokenizer is built
SAMPLE_PROMPT = "What is 12 + 30?"
TEMPLATE_SECONDS = 5.0                 # rendering SAMPLE_PROMPT takes at most this
TEMPLATE_MAX_CHARS = 1_000_000         # ... and gives at most this many characters
TEMPLATE_EXTRA_MEMORY = 1024 ** 3      # ... in at most this much address space beyond the process's own


def _check_files(path: Path) -> None:
    """Every tokenizer file present is a regular file inside the directory, and a vocabulary is among them."""
    present = {name for name in TOKENIZER_FILES if checkpoint_file(path, name) is not None}
    if not any(set(group) <= present for group in VOCAB_FILES):
        others = ", ".join(" + ".join(g) for g in VOCAB_FILES[1:])
        raise TidalError("model.path", str(path / "tokenizer.json"),
                         f"tokenizer.json is missing, and no other vocabulary ({others}) is in {path}: transformers "
                         "would build a tokenizer without a vocabulary, which encodes a prompt as one token or none",
                         "copy tokenizer.json from the model's source into the directory (tokenizer.save_pretrained"
                         "(dir) writes it)")


def _limit_memory(extra: int) -> None:
    """Cap this process's address space at its current size + `extra` (Linux; elsewhere no cap)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
        resource.setrlimit(resource.RLIMIT_AS, (pages * os.sysconf("SC_PAGE_SIZE") + extra, resource.RLIM_INFINITY))
    except (OSError, ValueError, IndexError):
        pass


def _in_child(fn: Callable[[], str], out_fd: int) -> NoReturn:
    """The forked renderer: run `fn` under the memory cap and send (kind, payload) back; never returns, so the
    parent's code (its stack, atexit handlers, buffered output) never runs twice."""
    try:
        _limit_memory(TEMPLATE_EXTRA_MEMORY)
        try:
            msg: tuple[str, object] = ("ok", len(fn()))
        except TidalError as err:
            msg = ("tidal", err)
        except BaseException as err:  # noqa: BLE001 - whatever the template does, the parent reports it
            msg = ("error", f"{type(err).__name__}: {err}"[:300])
        try:
            data = pickle.dumps(msg)
        except Exception:  # noqa: BLE001 - an error whose value does not pickle: its words suffice
            data = pickle.dumps(("error", str(msg[1])[:300]))
        with os.fdopen(out_fd, "wb") as w:
            w.write(data)
    finally:
        os._exit(0)


def _read_child(fd: int, deadline: float) -> bytes | None:
    """What the child sent (empty if it died first), or None if it had not finished by `deadline`."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def render_bounded(fn: Callable[[], str], where: str, seconds: float = TEMPLATE_SECONDS,
                   max_chars: int = TEMPLATE_MAX_CHARS) -> None:
    """Run `fn` (a chat template's rendering) once in a forked child, killed after `seconds`, its address space
    capped at TEMPLATE_EXTRA_MEMORY beyond the parent's; TidalError naming the template when it does not finish,
    fails, or gives more than `max_chars` characters (its value: `where`, the tokenizer's directory). A jinja sandbox
    bounds what a template may touch but not how long it runs, and a thread cannot be stopped: a process can. The
    child reports only the text's length; the parent renders real prompts itself, once the template is known to
    terminate."""
    fix = ("fix the tokenizer's chat template (chat_template.jinja or tokenizer_config.json), or set "
           "data.apply_chat_template: false")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _in_child(fn, w)
    os.close(w)
    data = None
    try:
        data = _read_child(r, time.monotonic() + seconds)
    finally:
        os.close(r)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if data is None:
        raise TidalError("data.apply_chat_template", where, "the chat template did not finish rendering a one-line "
                         f"conversation within {seconds:g} s", fix)
    if not data:
        raise TidalError("data.apply_chat_template", where, "the chat template crashed its renderer (a signal, or "
                         f"more than {TEMPLATE_EXTRA_MEMORY // 1024 ** 2} MB of memory)", fix)
    kind, payload = pickle.loads(data)   # our own child's message
    if kind == "tidal":
        raise payload
    if kind == "error":
        raise TidalError("data.apply_chat_template", where, f"the chat template failed to render ({payload})", fix)
    if payload > max_chars:
        raise TidalError("data.apply_chat_template", where, f"the chat template renders a one-line conversation as "
                         f"{payload:,} characters, more than {max_chars:,}", fix)


class HFTokenizer:
    """A checkpoint directory's tokenizer (see module doc)."""

    def __init__(self, path: str | Path, apply_chat_template: bool | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, *, check_template: bool = True):
        """`check_template`: render the chat template once, bounded (`render_bounded`), before trusting it. The
        driver's tokenizer does (`tidal validate`, `tidal train`, `tidal model check`); a worker rebuilding the
        same directory's tokenizer from its `TokenizerSpec` does not fork again."""
        from transformers import AutoTokenizer

        self.path = Path(path)
        _check_files(self.path)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged tokenizer file (the tokenizers library raises Exception)
            raise TidalError("model.path", str(path), f"holds no tokenizer transformers can load ({type(err).__name__}"
                             f": {' '.join(str(err).split())[:200]})",
                             "restore the tokenizer files saved with the model (tokenizer.save_pretrained(dir))") \
                from None
        sample = self.hf.encode(SAMPLE_TEXT, add_special_tokens=False)
        if len(sample) <= 1:
            raise TidalError("model.path", str(path), f"its tokenizer encodes the sentence {SAMPLE_TEXT!r} as "
                             f"{len(sample)} token(s): it has no real vocabulary",
                             "restore the tokenizer files saved with the model (tokenizer.json)")
        has_template = bool(getattr(self.hf, "chat_template", None))
        if apply_chat_template and not has_template:
            raise TidalError("data.apply_chat_template", True, f"the tokenizer in {path} has no chat template",
                             "set data.apply_chat_template: false to encode prompts as plain text, or add a "
                             "chat_template to the tokenizer")
        self.chat = has_template if apply_chat_template is None else apply_chat_template
        self.template_kwargs = dict(chat_template_kwargs or {})
        if self.chat and check_template:
            render_bounded(lambda: self.render(SAMPLE_PROMPT), str(self.path))
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
        return HFTokenizer(self.path, self.apply_chat_template, json.loads(self.chat_template_kwargs),
                           check_template=False)   # the driver checked this directory before any worker started


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
