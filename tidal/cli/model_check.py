"""`tidal model check DIR`: what a user runs first on a Hugging Face checkpoint directory.

    tidal model check /models/Qwen2.5-1.5B-Instruct [--json out.json] [--max-seq-len N] [--prompt TEXT]
                                                    [--no-parity] [--tolerance 1e-3]

Reads the directory the way a run does (`engine.hf_checkpoint.read_hf_config`, strict) and reports:

    model        family (`architectures`), model_type, parameters, dtype (config.json and the stored tensors),
                 embedding rows vs tokenizer size (a padded embedding is noted), layers / hidden / heads /
                 kv heads / head_dim, qkv_bias, qk_norm, RoPE type, tied embeddings, max_position_embeddings
    weights      the safetensors headers against the parameters Tidal builds (names and shapes, no data read)
    tensor par.  the TP sizes `check_tp` accepts (divisors of both num_heads and num_kv_heads)
    tokenizer    loads with local files only (`engine.hf_tokenizer.HFTokenizer`), stop ids, pad id, chat
                 template, an example prompt as the model sees it with its token count, a decode(encode(text))
                 round trip of a plain sentence
    parity       Tidal's model (`load_hf_weights` into `Transformer`, fp32) against
                 `transformers.AutoModelForCausalLM` (fp32) on the example prompt's ids (at most 128 tokens):
                 max |logit difference| and whether the greedy next token agrees. Both load on CPU in fp32, one
                 after the other: it needs about params x 4 bytes x 2 of memory (said in the output); `--no-parity`
                 skips it, and it is skipped (said why) when transformers is not installed or the machine's
                 available memory is below that

An unsupported or broken checkpoint (an unsupported family or RoPE type, MoE, a missing, extra or misshapen tensor,
a damaged safetensors header or a truncated weight file, a config.json field of the wrong type or an impossible
size, a file that is a symlink loop, a device or outside the directory, no tokenizer vocabulary, a chat template
that does not terminate, a tokenizer larger than the embedding...) is a `TidalError` naming what is unsupported,
raised by the same checks, in the same order, as `tidal validate` makes (`hf_checkpoint.read_hf_config`, then
`weight_inventory`, then `HFTokenizer`): the CLI prints it on one line and exits 2, and `--json` then holds
`{"supported": false, "error": ...}`. Exit 1 when the checkpoint loads but parity fails (difference above
`--tolerance`, or a different greedy token); 0 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tidal.cli.main import print_usage
from tidal.core.errors import TidalError
from tidal.engine.checkpoint import CheckpointError
from tidal.engine.hf_checkpoint import load_hf_weights, read_hf_config, weight_inventory
from tidal.engine.hf_tokenizer import HFTokenizer
from tidal.engine.model import Transformer, check_tp

DEFAULT_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                  "How many clips did Natalia sell altogether in April and May? Let's think step by step and "
                  "output the final answer after \"####\".")
ROUND_TRIP_TEXT = "The quick brown fox jumps over the lazy dog, 12 times in 3.5 seconds."
PARITY_TOKENS = 128
DEFAULT_TOLERANCE = 1e-3
#: longest run length assumed when --max-seq-len is not given (capped by max_position_embeddings)
DEFAULT_MAX_SEQ_LEN = 4096


def _bad(field: str, value: object, problem: str, fix: str) -> TidalError:
    return CheckpointError(field, value, problem, fix)


def _transformers():
    """The `transformers` module, or None when it is not installed (it is a dependency, but optional here)."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 1024 ** 3:.1f} GiB" if n >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"


def tp_sizes(args) -> list[int]:
    """Every TP size `check_tp` accepts: the common divisors of num_heads and num_kv_heads (<= num_kv_heads)."""

    out = []
    for d in range(1, args.num_kv_heads + 1):
        try:
            check_tp(args, d)
        except TidalError:
            continue
        out.append(d)
    return out


def _weight_inventory(hf) -> dict[str, Any]:
    """The safetensors headers against `param_specs` (`hf_checkpoint.weight_inventory`: the rules of
    `load_hf_weights`, no tensor data read)."""

    inv = weight_inventory(hf)
    return {"files": len(inv.files), "tensors": len(inv.location), "bytes": inv.nbytes, "dtypes": sorted(inv.dtypes)}


def _tokenizer(path: Path, prompt: str, model_vocab: int) -> tuple[Any, dict[str, Any]]:
    """The tokenizer as a run builds it (`HFTokenizer`: its files, its vocabulary and its chat template checked,
    with the errors `tidal validate` gives) and what the report says of it."""
    tok = HFTokenizer(path)
    if tok.vocab_size > model_vocab:
        raise _bad("model.path", str(path), f"its tokenizer has {tok.vocab_size} tokens, more than the model's "
                   f"{model_vocab} embedding rows", "use the tokenizer saved with the model")
    rendered = tok.render(prompt)
    ids = tok.prompt_ids(prompt)
    if not ids:
        raise _bad("model.path", str(path), "its tokenizer encodes the example prompt as no tokens at all",
                   "restore the tokenizer files saved with the model")
    bad_ids = [i for i in ids if not 0 <= i < model_vocab]
    if bad_ids:
        raise _bad("model.path", bad_ids[:3], f"the tokenizer produces ids outside the model's {model_vocab} "
                   "embedding rows", "use the tokenizer saved with the model")
    rt_ids = list(tok.hf.encode(ROUND_TRIP_TEXT, add_special_tokens=False))
    back = tok.hf.decode(rt_ids, skip_special_tokens=True)
    info = {
        "tokenizer_class": type(tok.hf).__name__,
        "tokenizer_vocab_size": tok.vocab_size,
        "stop_ids": list(tok.stop_ids),
        "stop_tokens": [tok.hf.convert_ids_to_tokens(int(i)) for i in tok.stop_ids],
        "pad_id": tok.pad_id,
        "has_chat_template": tok.has_chat_template,
        "prompt": prompt,
        "rendered_prompt": rendered,
        "prompt_tokens": len(ids),
        "round_trip": {"text": ROUND_TRIP_TEXT, "decoded": back, "tokens": len(rt_ids), "ok": back == ROUND_TRIP_TEXT},
    }
    return ids, info


def _logits_tidal(hf, ids):


    weights = load_hf_weights(hf)
    model = Transformer(hf.args).eval()
    model.load_global(weights)
    del weights
    with torch.no_grad():
        out = model.full_logits(model(torch.tensor([ids])))[0].float()
    del model
    gc.collect()
    return out


def _logits_transformers(transformers, path: str, ids):

    hf_logging = transformers.utils.logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()   # no "Loading weights" bar between the table's lines
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].float()
    del model
    gc.collect()
    return out


def _parity(hf, ids: list[int], transformers, tolerance: float) -> dict[str, Any]:
    ids = ids[:min(PARITY_TOKENS, hf.args.max_seq_len)]
    ours = _logits_tidal(hf, ids)
    try:
        theirs = _logits_transformers(transformers, hf.path, ids)
    except Exception as err:  # noqa: BLE001 - Tidal loads it, transformers does not: report, do not crash
        return {"status": "failed", "reason": f"transformers could not run it ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:200]})", "tokens": len(ids), "max_abs_logit_diff": None}
    if ours.shape != theirs.shape:
        return {"status": "failed", "reason": f"logit shapes differ: Tidal {tuple(ours.shape)}, transformers "
                f"{tuple(theirs.shape)}", "tokens": len(ids), "max_abs_logit_diff": None}
    diff = (ours - theirs).abs().max().item()
    ours_next, theirs_next = int(ours[-1].argmax()), int(theirs[-1].argmax())
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    ok = math.isfinite(diff) and diff <= tolerance and ours_next == theirs_next
    return {"status": "ok" if ok else "failed", "tokens": len(ids), "max_abs_logit_diff": diff,
            "max_abs_logit": theirs.abs().max().item(), "tolerance": tolerance,
            "greedy_next_token_tidal": ours_next, "greedy_next_token_transformers": theirs_next,
            "greedy_next_token_match": ours_next == theirs_next, "argmax_agreement": agree,
            "reason": None if ok else (f"max |logit diff| {diff:.3g} > tolerance {tolerance:g}" if not diff <= tolerance
                                       else "the greedy next tokens differ")}


def check(path: str | Path, *, max_seq_len: int | None = None, prompt: str = DEFAULT_PROMPT, parity: bool = True,
          tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Check a Hugging Face checkpoint directory (see module doc). Returns the report; raises TidalError (most
    often `CheckpointError`) naming what is unsupported or broken."""

    root = Path(path)
    if max_seq_len is not None and max_seq_len < 2:
        raise TidalError("--max-seq-len", max_seq_len, "must be at least 2", "e.g. --max-seq-len 2048")
    if not prompt.strip():
        raise TidalError("--prompt", prompt, "is empty", "pass a question, or leave --prompt out for the default")
    probe = read_hf_config(root, 1)   # everything but the run-length checks
    msl = max_seq_len or min(probe.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    hf = read_hf_config(root, msl)
    a = hf.args
    report = _model_report(hf, root, msl)
    report["weights"] = _weight_inventory(hf)
    transformers = _transformers()
    ids: list[int] | None = None
    if transformers is None:
        report.update(tokenizer="not installed (transformers)", tokenizer_vocab_size=None, has_chat_template=None,
                      stop_ids=None, pad_id=None, padded_embedding_rows=None)
    else:
        ids, info = _tokenizer(root, prompt, a.vocab_size)
        report.update(info)
        report["padded_embedding_rows"] = a.vocab_size - info["tokenizer_vocab_size"]
    par = _parity_report(hf, ids, transformers, parity, tolerance)
    report["parity"] = par
    report["max_abs_logit_diff"] = par["max_abs_logit_diff"]
    report["ok"] = par["status"] != "failed"
    return report


def _model_report(hf, root: Path, msl: int) -> dict[str, Any]:
    """The report's model section: what config.json and the stored tensors say, for a run of `msl` tokens."""
    a, cfg = hf.args, hf.config
    return {
        "supported": True,
        "path": str(root),
        "architecture": hf.architecture,
        "model_type": cfg.get("model_type"),
        "num_params": hf.num_params,
        "dtype": hf.dtype,
        "vocab_size": a.vocab_size,
        "num_layers": a.num_layers,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "qkv_bias": a.qkv_bias,
        "qk_norm": a.qk_norm,
        "rope_type": a.rope_scaling.rope_type,
        "rope_theta": a.rope_theta,
        "tie_embeddings": a.tie_embeddings,
        "max_position_embeddings": hf.max_position_embeddings,
        "max_seq_len": msl,
        "tp_sizes": tp_sizes(a),
    }


def _parity_report(hf, ids: list[int] | None, transformers, parity: bool, tolerance: float) -> dict[str, Any]:
    """The report's parity section: run, or skipped with the reason (asked, no transformers, too little memory)."""
    parity_bytes = hf.num_params * 4 * 2
    par: dict[str, Any] = {"memory_bytes": parity_bytes, "max_abs_logit_diff": None}
    avail = _available_memory()
    if not parity:
        par.update(status="skipped", reason="--no-parity")
    elif transformers is None:
        par.update(status="skipped", reason="transformers not installed")
    elif avail is not None and parity_bytes > avail:
        par.update(status="skipped", reason=f"needs about {_gib(parity_bytes)} of memory, {_gib(avail)} available "
                   "(run it on a larger machine, or pass --no-parity)")
    else:
        par.update(_parity(hf, cast(list[int], ids), transformers, tolerance))  # read: transformers is there
    return par


def _yes(v: Any) -> str:
    return "yes" if v is True else "no" if v is False else "-" if v is None else str(v)


def print_report(r: dict[str, Any], console=None) -> None:

    console = console or Console()
    t = Table(title=f"tidal model check: {escape(r['path'])}", show_header=False, title_justify="left")
    t.add_column("", style="bold")
    t.add_column("")

    def row(k: str, v: Any) -> None:
        t.add_row(k, escape(_yes(v)))

    row("family", f"{r['architecture']} (model_type {r['model_type']})")
    n = r["num_params"]
    row("parameters", f"{n:,} ({n / 1e9:.2f} B)" if n >= 1e8 else f"{n:,} ({n / 1e6:.2f} M)")
    w = r["weights"]
    row("dtype on disk", f"{r['dtype']} (config.json); tensors: {', '.join(w['dtypes'])}; "
                         f"{w['tensors']} tensors in {w['files']} file(s), {_gib(w['bytes'])}")
    tv = r.get("tokenizer_vocab_size")
    vocab = f"{r['vocab_size']:,} embedding rows"
    if tv is not None:
        vocab += f", tokenizer {tv:,} tokens" + (f" (embedding padded by {r['padded_embedding_rows']:,} rows)"
                                                 if r["padded_embedding_rows"] else " (equal)")
    row("vocab", vocab)
    row("layers / hidden / mlp", f"{r['num_layers']} / {r['hidden_size']} / {r['intermediate_size']}")
    row("heads / kv heads / head_dim", f"{r['num_heads']} / {r['num_kv_heads']} / {r['head_dim']}")
    row("qkv_bias / qk_norm", f"{_yes(r['qkv_bias'])} / {_yes(r['qk_norm'])}")
    row("rope", f"{r['rope_type']}, theta {r['rope_theta']:g}")
    row("tied embeddings", r["tie_embeddings"])
    row("max_position_embeddings", f"{r['max_position_embeddings']:,} (checked for a run of {r['max_seq_len']:,} "
                                   "tokens; --max-seq-len)")
    row("tensor parallel sizes", ", ".join(map(str, r["tp_sizes"])))
    if isinstance(r.get("tokenizer"), str):
        row("tokenizer", r["tokenizer"])
    else:
        row("tokenizer", f"{r['tokenizer_class']} (local files)")
        row("stop ids", ", ".join(f"{i} {s!r}" for i, s in zip(r["stop_ids"], r["stop_tokens"])))
        row("pad id", r["pad_id"])
        row("chat template", r["has_chat_template"])
        row("example prompt", f"{r['prompt_tokens']} tokens:\n{r['rendered_prompt']}")
        rt = r["round_trip"]
        row("decode(encode(text))", "ok" if rt["ok"] else f"differs: {rt['decoded']!r}")
    p = r["parity"]
    mem = f"needs ~{_gib(p['memory_bytes'])} RAM (params x 4 B x 2)"
    if p["status"] == "skipped":
        row("parity vs transformers", f"skipped: {p['reason']}; {mem}")
    elif p["max_abs_logit_diff"] is None:
        row("parity vs transformers", f"[red]failed[/]: {p['reason']}")
    else:
        verdict = "ok" if p["status"] == "ok" else f"FAILED: {p['reason']}"
        row("parity vs transformers",
            f"{verdict}; max |logit diff| {p['max_abs_logit_diff']:.3g} over {p['tokens']} tokens "
            f"(max |logit| {p['max_abs_logit']:.3g}); greedy next token "
            f"{'agrees' if p['greedy_next_token_match'] else 'differs'} ({p['greedy_next_token_tidal']} vs "
            f"{p['greedy_next_token_transformers']}), argmax agreement {p['argmax_agreement']:.0%}; fp32 on CPU, {mem}")
    console.print(t)
    if r["ok"]:
        console.print(f"[green]supported[/]: {escape(r['architecture'])} loads into Tidal"
                      + ("" if p["status"] == "ok" else " (parity not checked)"))
    else:
        console.print(f"[red]parity failed[/]: {escape(p['reason'] or '')}")


def _write_json(path: str, doc: dict[str, Any]) -> None:
    try:
        Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as err:
        raise TidalError("--json", path, f"cannot be written ({err.strerror})", "pass a writable path") from None


def main(argv: list[str]) -> int:
    """`tidal model check DIR ...`: exit 0 supported (and parity ok or skipped), 1 parity failed, 2 (TidalError,
    raised to the CLI) unsupported or broken."""
    ap = argparse.ArgumentParser(prog="tidal model check",
                                 description="Check a Hugging Face checkpoint directory before training on it.")
    ap.add_argument("dir", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as a JSON object")
    ap.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                    help="the run's longest prompt + response (default: max_position_embeddings, at most "
                         f"{DEFAULT_MAX_SEQ_LEN})")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="example prompt (default: a GSM8K question)")
    ap.add_argument("--no-parity", action="store_true",
                    help="skip the logit comparison with transformers (loads the model twice in fp32 on CPU)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help=f"largest max |logit diff| that passes (default {DEFAULT_TOLERANCE:g})")
    args = ap.parse_args(argv)
    try:
        report = check(args.dir, max_seq_len=args.max_seq_len, prompt=args.prompt, parity=not args.no_parity,
                       tolerance=args.tolerance)
    except TidalError as err:
        if args.json:
            _write_json(args.json, {"supported": False, "error": str(err), "field": err.field,
                                    "path": str(args.dir)})
        raise
    print_report(report)
    if args.json:
        _write_json(args.json, report)
    return 0 if report["ok"] else 1


VERBS = {"check": (main, "check a Hugging Face checkpoint directory: family, size, TP sizes, tokenizer, "
                         "logit parity with transformers")}


def model_main(argv: list[str]) -> int:
    """`tidal model VERB ...`."""
    if not argv or argv[0] in ("-h", "--help"):
        print_usage("usage: tidal model VERB [ARGS...]", "verbs", VERBS,
                    "`tidal model VERB --help` for a verb's options.")
        return 0 if argv else 2
    if argv[0] not in VERBS:
        raise TidalError("tidal model", argv[0], "is not a verb of `tidal model`",
                         f"use one of: {', '.join(VERBS)} (e.g. tidal model check DIR)")
    return VERBS[argv[0]][0](argv[1:])
