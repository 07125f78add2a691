"""``neorec eval``: a saved model's AUC, log loss, NE and calibration on data."""

from __future__ import annotations

import argparse

HELP = "evaluate a saved model: AUC, log loss, NE, calibration"

MODEL_HELP = "a run folder (its model/ is used) or a model directory written by save_model"
DATA_HELP = (
    "data to read instead of the config's eval split: a Criteo TSV file or directory of them "
    "(every line, in order) or a preprocessed directory (its held-out split if it has one, else "
    "all of it)"
)


def model_arguments(
    p: argparse.ArgumentParser, data_help: str = DATA_HELP, model_help: str = MODEL_HELP
) -> None:
    """The flags ``eval`` and ``predict`` share: the model, the data and its overrides."""
    p.add_argument("--model", required=True, metavar="RUN", help=model_help)
    p.add_argument("--data", metavar="PATH", help=data_help)
    p.add_argument(
        "--window",
        type=int,
        metavar="W",
        help="stream data (data.source = stream): read window W of the stream (the same as "
        "--set data.window=W; data.windows is raised to W + 1 if needed)",
    )
    p.add_argument(
        "--split",
        choices=["train", "eval"],
        default="eval",
        help="synthetic / stream data: which split of the config's data (default: eval)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="data.KEY=VALUE",
        help="override the saved config's data section (repeatable), e.g. --set "
        "data.eval_samples=10000; also train.threads and train.bf16_dense",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec eval``."""
    model_arguments(p)
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line too")
    p.add_argument(
        "--exclude-seen",
        choices=["on", "off"],
        help="a sequential run: remove each user's history from the candidates (default: as "
        "the run was configured)",
    )


def run(args: argparse.Namespace) -> int:
    """Evaluate; print the metrics."""
    from neorec.serve.sequential import is_sequential_run

    if is_sequential_run(args.model):
        return _sequential(args)
    from neorec.serve.commands import run_eval

    return run_eval(args)


def _sequential(args: argparse.Namespace) -> int:
    """A ``[sequential]`` run: HR / NDCG / MRR of its validation and test targets, full corpus."""
    import json

    from neorec.serve.sequential import eval_run, metrics_line

    excl = None if args.exclude_seen is None else args.exclude_seen == "on"
    res = eval_run(args.model, args.data, excl)
    for split in ("valid", "test"):
        print(metrics_line(split, res[split], res["candidates"], res["exclude_seen"]), flush=True)
    if args.json:
        print(json.dumps(res, sort_keys=True), flush=True)
    return 0
