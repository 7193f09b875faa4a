"""`legorl convert`: move a model between HF checkpoint directories and Orbax.

legorl convert --from-hf DIR --to-hf OUT [--dtype bfloat16] [--max-shard-size 5GB]
legorl convert --from-orbax CKPT --config-from HF_DIR --to-hf OUT [--step N]
legorl convert --from-hf DIR --to-orbax CKPT
legorl convert --from-hf BASE --adapter PEFT_DIR --to-hf OUT      (the adapter merged into the weights)
legorl convert --from-orbax CKPT --config-from BASE --to-peft OUT  (a LoRA run's adapters, PEFT's format)

A LoRA run's checkpoint holds its adapters only: --config-from must then be the base
model's HF directory (the run's model.path), whose weights the adapters go onto.
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
    dst.add_argument("--to-peft", metavar="DIR", help="write the model's LoRA adapters as a PEFT adapter directory")
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter to add onto --from-hf's model")
    parser.add_argument(
        "--config-from",
        metavar="DIR",
        help="HF directory whose config.json and tokenizer to use (a LoRA run's checkpoint: its base, weights too)",
    )
    parser.add_argument("--step", type=int, help="Orbax step to read (default: latest)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="stored dtype (default: the source's)")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB", help="HF shard file limit (5GB)")


def run(args: argparse.Namespace) -> int:
    from legorl_jax.core.safetensors_io import SafetensorsFileError
    from legorl_jax.models import CheckpointError, UnsupportedConfigError
    from legorl_jax.models.lora import LoraError

    if args.from_orbax and not args.config_from:
        print("legorl convert: --from-orbax needs --config-from (the HF directory of the model)", file=sys.stderr)
        return 2
    if args.adapter and not (args.from_hf and args.to_hf):
        print("legorl convert: --adapter goes onto --from-hf's model (its base), merged into --to-hf", file=sys.stderr)
        return 2
    try:
        out = _convert(args)
    except (CheckpointError, UnsupportedConfigError, SafetensorsFileError, LoraError) as exc:
        print(f"legorl convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace) -> Path:
    from legorl_jax.models import from_hf, from_hf_config, read_hf_config, to_hf
    from legorl_jax.models.lora import load_peft, save_peft
    from legorl_jax.models.orbax_io import load_adapters, load_params, save_params, saved_lora

    if args.from_hf:
        hf_config = read_hf_config(args.from_hf)
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        dtype: DType = args.dtype or (stored if stored in ("float32", "bfloat16") else "float32")
        model = from_hf(args.from_hf, dtype=dtype)
        if args.adapter:
            load_peft(model, args.adapter)
        tokenizer_from = args.config_from or args.from_hf
    elif saved_lora(args.from_orbax, step=args.step) is not None:
        model = load_adapters(args.from_orbax, from_hf(args.config_from), step=args.step)
        tokenizer_from = args.config_from
    else:
        config = from_hf_config(read_hf_config(args.config_from))
        model = load_params(args.from_orbax, config, step=args.step)
        tokenizer_from = args.config_from
    if args.to_peft:
        return save_peft(model, args.to_peft, base_model=str(Path(tokenizer_from).resolve()))
    if args.to_hf:
        return to_hf(
            model, args.to_hf, tokenizer_from=tokenizer_from, dtype=args.dtype, max_shard_bytes=args.max_shard_size
        )
    return save_params(model, args.to_orbax)
