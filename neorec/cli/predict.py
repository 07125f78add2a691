"""``neorec predict``: batch inference of a saved model (probabilities, or DAS logits)."""

from __future__ import annotations

import argparse

from neorec.cli.eval import DATA_HELP, MODEL_HELP, model_arguments

HELP = "batch inference: click probabilities (float32 .npy) of every sample, in data order"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec predict``."""
    model_arguments(
        p,
        DATA_HELP + "; default: the config's eval split (the trainer's eval order)",
        MODEL_HELP + "; or a serving artifact (neorec export): predictions through its tables "
        "as exported (fp16, int8, int4, int2)",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out",
        metavar="PREDS.npy",
        help="where to write the probabilities: float32 [samples], sigmoid of the model's logits "
        "(what the trainer's eval computes), in the order of the data",
    )
    where.add_argument(
        "--das",
        metavar="DIR",
        help="stream data: write the model's float32 LOGITS of --window's --split as a DAS side "
        "file DIR/fm_w{W}_{split}.npy + .json (the model is the FM of the window it was trained "
        "on), for students' data.fm_logits = DIR",
    )


def run(args: argparse.Namespace) -> int:
    """Predict; write the file."""
    from neorec.serve.commands import run_predict

    return run_predict(args)
