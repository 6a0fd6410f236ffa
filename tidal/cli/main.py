"""`tidal` command line. Each sub-command is a thin shell over library code.

User errors (`TidalError`) print one line naming the field, the value and the fix, and exit 2; there are no
tracebacks for bad input.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import importlib
import importlib.util
import io
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.table import Table

from tidal.convert.rlinf import Conversion, to_yaml
from tidal.core.config import build_config
from tidal.core.errors import TidalError
from tidal.core.placement import COMPONENTS, Mode, format_ids
from tidal.pipeline.sharing import Sharing
from tidal.pipeline.tracked_run import load_run_config

if TYPE_CHECKING:
    from tidal.engine.hf_checkpoint import HFModel

#: sub-command -> ("module:function" taking argv and returning an exit code, one-line help).
#: Sub-commands whose body lives in another package are imported only when used (fast `--help`).
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("tidal.cli.main:validate_main", "check a config and print its placement"),
    "convert": ("tidal.cli.main:convert_main", "convert another framework's config: `tidal convert rlinf FILE`"),
}


def print_usage(usage: str, title: str, entries: Mapping[str, tuple[object, str]], footer: str,
                width: int = 8) -> None:
    """A sub-command table: `usage`, then each entry's name and one-line help (the second item of its value)."""
    print(f"{usage}\n\n{title}:")
    for name, (_, text) in entries.items():
        print(f"  {name:<{width}} {text}")
    print(f"\n{footer}")


def register(name: str, target: str, help_text: str) -> None:
    if name in COMMANDS:
        raise ValueError(f"sub-command {name!r} registered twice")
    COMMANDS[name] = (target, help_text)


def _optional(name: str, target: str, help_text: str) -> None:
    module = target.split(":")[0]
    if importlib.util.find_spec(module) is not None:
        register(name, target, help_text)


_optional("model", "tidal.cli.model_check:model_main", "inspect a Hugging Face checkpoint: `tidal model check DIR`")
_optional("reshard-check", "tidal.cli.reshard_check:main", "self-test: reshard an actor between layouts, verify bytes")
_optional("train", "tidal.cli.train:main", "run an RL training job from a config")
_optional("warm-start", "tidal.pipeline.task_checkpoint:main",
          "a built-in task as a Hugging Face checkpoint + GSM8K-format prompt files (the main job's model)")
_optional("simulate", "scheduler.sim_cli:main", "simulate a run's scheduling at any scale")
_optional("plan", "scheduler.plan_cli:main",
          "predicted step time of every placement and policy for a config or workload, and the one to run")
_optional("sweep", "tidal.sweep:main", "Optuna sweep of scheduler policy settings")
_optional("compare", "tidal.cli.compare:main",
          "side-by-side table of MLflow runs, or of policies / sweeps (--group-by)")
_optional("up", "tidal.cli.services:up_main", "start local Prefect, MLflow and optuna-dashboard on 127.0.0.1")
_optional("down", "tidal.cli.services:down_main", "stop the services `tidal up` started")
_optional("serve", "flows.serve:main", "serve the Prefect deployments (trigger runs from the UI)")


def _resolve(target: str) -> Callable[..., Any]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def validate_main(argv: list[str]) -> int:

    ap = argparse.ArgumentParser(prog="tidal validate", description="Check a config; print its placement.")
    ap.add_argument("config", help="YAML config file")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--no-track", action="store_true", help="as `tidal train --no-track`: no database URL check")
    ap.add_argument("--resume", metavar="DIR", help="as `tidal train --resume DIR`: check that checkpoint too")
    args = ap.parse_args(argv)
    cfg = load_run_config(args.config, args.overrides)
    p = cfg.placement
    console = Console()
    console.print(f"[bold]{args.config}[/]: {p.mode.value} placement on {p.num_devices} devices "
                  f"({cfg.cluster.num_nodes} node(s) x {cfg.cluster.num_devices_per_node})")
    table = Table()
    table.add_column("device", justify="right")
    table.add_column("component")
    for d, owners in p.owners().items():
        table.add_row(str(d), ",".join(owners) or "(free)")
    console.print(table)
    sizes = Table(title="components")
    for col in ("component", "devices", "tensor parallel", "instances / dp"):
        sizes.add_column(col)
    for comp in COMPONENTS:
        tp = getattr(cfg, comp).tensor_parallel_size
        ids = p.of(comp)
        sizes.add_row(comp, format_ids(ids), str(tp), str(len(ids) // tp))
    console.print(sizes)
    console.print(f"actor backend: [bold]{cfg.actor.backend}[/] (actor.backend)")
    if p.mode is Mode.AUTO:
        tp = cfg.actor.tensor_parallel_size
        lo, hi = len(p.actor) // tp, p.num_devices // tp
        seqs = cfg.sequences_per_iter
        g = cfg.algorithm.group_size
        rlinf = [dp for dp in range(lo, hi + 1) if seqs % (dp * g) == 0]
        console.print(f"auto scheduler: policy [bold]{cfg.scheduler.policy}[/]; actor dp reachable: "
                      f"{lo}..{hi} (any size; tp={tp}); RLinf's rule would allow only {rlinf}")
        console.print(f"flags: use_pre_process_policy={cfg.cluster.use_pre_process_policy}, "
                      f"use_wait_before_last_iter_policy={cfg.cluster.use_wait_before_last_iter_policy}")
    elif p.mode in (Mode.COLLOCATED, Mode.HYBRID):   # who takes turns on the shared devices, phase by phase
        console.print(f"static {p.mode.value} placement; each step:")
        for line in Sharing.of(p, cfg.actor).plan(p):
            console.print(f"  {line}")
    # every check `tidal train` makes before a worker starts: the model, tokenizer, prompts and verifier as it
    # reads them, the device kind, the cores, the database URL, a resume checkpoint
    from tidal.pipeline.memory_plan import plan_for
    from tidal.pipeline.preflight import preflight
    inputs, kind = preflight(cfg, tracked=not args.no_track, resume_from=args.resume)
    if cfg.model.path:
        hf = cast("HFModel", inputs.hf)  # read from model.path
        console.print(f"model: {hf.architecture} from {cfg.model.path}, {inputs.args.num_params():,} "
                      f"parameters; tokenizer {inputs.tok.vocab_size} tokens; reward {inputs.reward}; "
                      f"prompts {inputs.source.summary()}")
    else:
        console.print(f"model: Tidal's own, {inputs.args.num_params():,} parameters; task {cfg.data.task}; "
                      f"reward {inputs.reward}")
    console.print(f"devices: {kind} ({'GPUs' if kind == 'cuda' else 'CPU virtual devices'})")
    console.print(plan_for(cfg, inputs.args, kind).summary())
    console.print(f"[green]ok[/]: {cfg.data.rollout_batch_size} prompts x {cfg.algorithm.group_size} samples per "
                  f"step, {cfg.algorithm.n_minibatches} iters of {cfg.sequences_per_iter} sequences")
    return 0


#: `tidal convert SOURCE FILE`: source framework -> "module:function" (path -> Conversion) and its help
CONVERTERS: dict[str, tuple[str, str]] = {
    "rlinf": ("tidal.convert.rlinf:convert_file", "an RLinf experiment YAML (Hydra/OmegaConf) -> a Tidal config"),
}


def convert_main(argv: list[str]) -> int:
    """`tidal convert rlinf FILE [-o PATH]`: the Tidal config as YAML on stdout (or in PATH); every key that could
    not be carried, with its reason, on stderr. Exit 0; a file that cannot be read or converted: TidalError."""
    if not argv or argv[0] in ("-h", "--help"):
        print_usage("usage: tidal convert SOURCE FILE [-o PATH]", "sources", CONVERTERS,
                    "`tidal convert SOURCE --help` for the options.")
        return 0 if argv else 2
    source, rest = argv[0], argv[1:]
    if source not in CONVERTERS:
        raise TidalError("tidal convert", source, "is not a config format Tidal converts",
                         f"use one of: {', '.join(CONVERTERS)} (e.g. tidal convert rlinf FILE)")
    ap = argparse.ArgumentParser(prog=f"tidal convert {source}",
                                 description=f"Convert {CONVERTERS[source][1].split(' -> ')[0]} to a Tidal config. "
                                             "The YAML goes to stdout (or -o PATH), the keys that could not be "
                                             "carried to stderr.")
    ap.add_argument("file", help="the config file to convert")
    ap.add_argument("-o", "--output", metavar="PATH", help="write the Tidal YAML here instead of stdout")
    args = ap.parse_args(rest)


    conv: Conversion = _resolve(CONVERTERS[source][0])(args.file)
    text = to_yaml(conv)
    if args.output:
        out = Path(args.output)
        try:
            out.write_text(text, encoding="utf-8")
        except OSError as err:
            raise TidalError("-o", args.output, f"cannot be written ({err.strerror})", "pass a writable path") \
                from None
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    log = sys.stderr
    for note in conv.notes:
        print(f"note: {note}", file=log)
    if conv.dropped:
        print(f"not carried ({len(conv.dropped)} {source} keys):", file=log)
        width = min(max(len(d.key) for d in conv.dropped), 48)
        for d in conv.dropped:
            print(f"  {d.key:<{width}}  {d.reason}", file=log)
    from tidal.pipeline.preflight import preflight
    try:   # every check of `tidal validate`, with the model and data files as this machine has them
        preflight(build_config(conv.config), tracked=False)
        verdict = "it validates here (`tidal validate` without --no-track also checks the database URL)"
    except TidalError as bad:
        verdict = f"warning: it does not validate here: {bad}"
    where = f"wrote {args.output}" if args.output else "converted"
    print(f"{where}: {len(conv.carried)} keys carried, {len(conv.dropped)} not carried; {verdict}", file=log)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt: a run shuts down the same way (its records say
    `aborted`, its workers stop) and the command exits 143 (128 + SIGTERM)."""


_sigterm_seen = False   # a cleanup path may re-raise a plain KeyboardInterrupt: the exit code still says SIGTERM


def _on_sigterm(signum, frame) -> None:
    global _sigterm_seen
    _sigterm_seen = True
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    dumps = _stack_dumps_on_sigusr1()
    try:
        return _main(argv)
    finally:
        if dumps:
            faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGTERM, previous)


def _stack_dumps_on_sigusr1() -> bool:
    """`kill -USR1 PID` prints every thread's stack to stderr: how a run that does not answer is inspected. Not
    where stderr is no file (a caller capturing it)."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True, chain=False)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return True


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print_usage("usage: tidal COMMAND [ARGS...]\n\nTidal: RL post-training with dynamic scheduling.", "commands",
                    COMMANDS, "`tidal COMMAND --help` for a command's options.", width=14)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        print(f"error: unknown command {name!r}.{hint} Run `tidal --help`.", file=sys.stderr)
        return 2
    try:
        return int(_resolve(COMMANDS[name][0])(rest) or 0)
    except TidalError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated) or _sigterm_seen
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
