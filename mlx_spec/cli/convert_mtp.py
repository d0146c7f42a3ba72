"""``mlx-spec convert-mtp HF_DIR MLX_DIR``: a model's MTP head, from its original checkpoint into
its MLX folder.

mlx-community conversions lack the MTP layers that Qwen3-Next, Qwen3.5 / 3.6, DeepSeek-V3 and
GLM-4.5 ship with. This reads them from the original Hugging Face checkpoint, prepares them as
mlx-lm prepares the model, quantizes them as the MLX folder's model is quantized and writes them
into that folder as ``mtp.safetensors`` (:func:`mlx_spec.mtp_convert.convert_mtp`), one line of
progress per step. ``mlx_spec.load`` then loads the model with its head, for ``drafter="mtp"``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ._common import CliError, Parser, Progress, run, shown, utf8_text


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec convert-mtp``."""
    parser = Parser(
        prog="mlx-spec convert-mtp",
        description=(
            "Read the MTP (multi-token prediction) layers of a model from its original Hugging "
            "Face checkpoint, prepare and quantize them as the model in MLX_DIR is, and write "
            "them into MLX_DIR as mtp.safetensors. Only the MTP weights are read. Families: "
            "Qwen3-Next, Qwen3.5 / 3.6, DeepSeek-V3, GLM-4.5."
        ),
        epilog=(
            "Then: mlx_spec.load(MLX_DIR) gives the model with its head, and drafter='mtp' "
            "drafts with it."
        ),
    )
    parser.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        type=utf8_text,
        help="the original checkpoint's folder (config.json, safetensors shards and their index)",
    )
    parser.add_argument(
        "mlx_dir",
        metavar="MLX_DIR",
        type=utf8_text,
        help="the MLX folder of the same model (mlx_lm.convert's, or mlx-community's)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mlx-spec convert-mtp``; returns the exit status (0, or 2 after a one-line error)."""
    return run(setup_arg_parser(), _convert, argv)


def _convert(args: argparse.Namespace) -> int:
    for name, role in ((args.hf_dir, "HF_DIR"), (args.mlx_dir, "MLX_DIR")):
        if not (Path(name).expanduser() / "config.json").is_file():
            raise CliError(
                f"{role} {shown(name)} is not a model folder (no config.json in it); give a "
                "local folder (download it first, e.g. with hf download)"
            )
    # Imported once the arguments are checked: MLX and mlx-lm are slow to import.
    from ..mtp_convert import convert_mtp

    progress = Progress()
    try:
        written = convert_mtp(args.hf_dir, args.mlx_dir, on_progress=progress)
    except (ValueError, OSError) as error:
        progress.clear()
        raise CliError(str(error)) from None
    progress.done()
    size = written.stat().st_size / 2**20
    print(
        f"Wrote {written} ({size:.1f} MiB); mlx_spec.load({str(args.mlx_dir)!r}) loads the model "
        "with its MTP head, for drafter='mtp'"
    )
    return 0
