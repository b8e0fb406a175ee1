"""Convert a Hugging Face Llama checkpoint to per-layer pipeline files, and back.

    python convert2ckpt.py --input HF_DIR --output CKPT_DIR [--dtype bf16|fp16|fp32]
    python convert2ckpt.py --to-hf --input CKPT_DIR [--tag TAG] --output HF_DIR [--dtype ...]
    python convert2ckpt.py --reshard --input RUN_DIR [--tag TAG] --output NEW_RUN_DIR
    python convert2ckpt.py --to-hf --input LORA_RUN_DIR --output ADAPTER_DIR [--merge] [--base-model HF_DIR]
        [--base-checkpoint BASE_CKPT_DIR]

Tensors are read and written one layer at a time, so the whole model is never in memory. Output is
written to ``<output>.tmp-<pid>`` and renamed at the end: a failed conversion leaves no output.
An --output that is, contains or lies inside the --input is refused; --overwrite replaces only a
directory this tool wrote (it holds the ``.llama-pipe-output`` marker).
The reading and writing is models/files/hf_convert.py; the key mapping is the prefix of each spec in
``models.llama_pipe.spec_layout``. ``--reshard`` turns a train.py checkpoint of any layout into one whose
optimizer states are safetensors per layer file (training/checkpoints/reshard.py, the code a resume on another
layout runs): resume it on any layout as ``output_dir``, or inspect it without DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import sys

from training.observation.logs import quiet_dependencies

quiet_dependencies("warning")  # as train.py does, before torch, DeepSpeed and bitsandbytes are imported

import torch  # noqa: E402

from models.files.hf_convert import DEFAULT_MAX_SHARD, ConversionError, hf_to_stages, stages_to_hf  # noqa: E402
from models.files.peft_adapter import export_adapter, lora_run_base  # noqa: E402
from models.files.pipeline_dir import CheckpointError, read_tag  # noqa: E402
from training.checkpoints.reshard import reshard  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Hugging Face model dir, or a pipeline checkpoint dir with --to-hf")
    p.add_argument("--output", required=True, help="directory to create (must not exist unless --overwrite)")
    p.add_argument("--to-hf", action="store_true", help="pipeline checkpoint -> Hugging Face safetensors")
    p.add_argument(
        "--reshard",
        action="store_true",
        help="train.py checkpoint -> portable optimizer states (any layout resumes it)",
    )
    p.add_argument(
        "--tag", default=None, help="with --to-hf or --reshard: checkpoint tag to read (default: the one in 'latest')"
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep each tensor's dtype)"
    )
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="with --to-hf: largest safetensors shard")
    p.add_argument(
        "--merge",
        action="store_true",
        help="with --to-hf of a LoRA run: a full Hugging Face model with the adapters merged, not an adapter dir",
    )
    p.add_argument(
        "--base-model",
        default=None,
        help="with --to-hf of a LoRA run: base_model_name_or_path to write in adapter_config.json "
        "(default: the run's model_name_or_path)",
    )
    p.add_argument(
        "--base-checkpoint",
        default=None,
        help="with --to-hf of a LoRA run: where its base pipeline checkpoint is now, if it moved "
        "(checked against the SHA-256s the run recorded)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --output if it exists and was written by this tool (only once conversion succeeded)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to_hf and args.reshard:
            raise ConversionError("--to-hf and --reshard are two conversions: choose one")
        if args.reshard:
            if dtype is not None:
                raise ConversionError("--dtype does not apply to --reshard (optimizer states stay fp32)")
            reshard(args.input, args.output, args.tag, args.overwrite)
        elif args.to_hf and lora_run_base(os.path.join(args.input, read_tag(args.input, args.tag))):
            export_adapter(
                args.input,
                args.output,
                args.tag,
                args.base_model,
                args.merge,
                dtype,
                args.overwrite,
                base_checkpoint=args.base_checkpoint,
            )
        elif args.to_hf:
            if args.merge or args.base_model or args.base_checkpoint:
                raise ConversionError(
                    "--merge, --base-model and --base-checkpoint apply to the checkpoint of a LoRA run only"
                )
            stages_to_hf(args.input, args.output, args.tag, dtype, args.max_shard_size, args.overwrite)
        else:
            if args.tag is not None or args.merge or args.base_model or args.base_checkpoint:
                raise ConversionError(
                    "--tag, --merge, --base-model and --base-checkpoint apply only with --to-hf (--tag: or --reshard)"
                )
            hf_to_stages(args.input, args.output, dtype, args.overwrite)
    except (ConversionError, CheckpointError, OSError, ValueError) as e:
        print(f"convert2ckpt.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
