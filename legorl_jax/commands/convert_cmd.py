"""`legorl convert`: move a model between HF checkpoint directories and Orbax.

legorl convert --from-hf DIR --to-hf OUT [--dtype bfloat16] [--max-shard-size 5GB]
legorl convert --from-orbax CKPT --config-from HF_DIR --to-hf OUT [--step N]
legorl convert --from-hf DIR --to-orbax CKPT
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the models import jax, which only `run` needs
    from legorl_jax.models.config import DType

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MiB' / '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF checkpoint directory to read")
    src.add_argument("--from-orbax", metavar="DIR", help="Orbax checkpoint directory (learner layout) to read")
    dst = parser.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-hf", metavar="DIR", help="write an HF checkpoint directory")
    dst.add_argument("--to-orbax", metavar="DIR", help="write an Orbax params checkpoint")
    parser.add_argument("--config-from", metavar="DIR", help="HF directory whose config.json and tokenizer to use")
    parser.add_argument("--step", type=int, help="Orbax step to read (default: latest)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="stored dtype (default: the source's)")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB", help="HF shard file limit (5GB)")


def run(args: argparse.Namespace) -> int:
    from legorl_jax.core.safetensors_io import SafetensorsFileError
    from legorl_jax.models import CheckpointError, UnsupportedConfigError

    if args.from_orbax and not args.config_from:
        print("legorl convert: --from-orbax needs --config-from (the HF directory of the model)", file=sys.stderr)
        return 2
    try:
        out = _convert(args)
    except (CheckpointError, UnsupportedConfigError, SafetensorsFileError) as exc:
        print(f"legorl convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace) -> Path:
    from legorl_jax.models import from_hf, from_hf_config, read_hf_config, to_hf
    from legorl_jax.models.orbax_io import load_params, save_params

    if args.from_hf:
        hf_config = read_hf_config(args.from_hf)
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        dtype: DType = args.dtype or (stored if stored in ("float32", "bfloat16") else "float32")
        model = from_hf(args.from_hf, dtype=dtype)
        tokenizer_from = args.config_from or args.from_hf
    else:
        config = from_hf_config(read_hf_config(args.config_from))
        model = load_params(args.from_orbax, config, step=args.step)
        tokenizer_from = args.config_from
    if args.to_hf:
        return to_hf(
            model, args.to_hf, tokenizer_from=tokenizer_from, dtype=args.dtype, max_shard_bytes=args.max_shard_size
        )
    return save_params(model, args.to_orbax)
