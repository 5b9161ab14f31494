"""write a merged checkpoint from a base checkpoint and a delta file

Stream BASE_DIR's shards into OUT_DIR with the entries of DELTA written in; refuses a base whose tensors differ
from the one the delta was made against.
"""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("base_dir", metavar="BASE_DIR")
    parser.add_argument("delta", metavar="DELTA")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument(
        "--unchecked-base",
        action="store_true",
        help="apply a delta that has no record of its base (the base cannot be checked)",
    )


def run(args) -> int:
    from usaf.base.checkpoint import BaseCheckpoint
    from usaf.export.merged import apply_delta, dequantized_note
    from usaf.io.model_source import base_folder
    from usaf.io.published import checkpoint_method

    args.base_dir = base_folder(args.base_dir, "BASE_DIR")  # a cached hub id's snapshot; a run refused
    path = apply_delta(
        args.base_dir, args.delta, args.out_dir, force=args.force, unchecked_base=args.unchecked_base
    )
    print(f"merged checkpoint: {path}")
    if checkpoint_method(args.base_dir) is not None:
        print(dequantized_note(BaseCheckpoint(args.base_dir), path))
    return 0
