"""``troupe detect-watermark``: whether a text carries the watermark a server started with
``--watermark-config`` puts in what it samples. The text is read with the model's tokenizer
(``--model``, or ``--tokenizer``), or given as token ids; the answer is one JSON line::

    troupe detect-watermark --watermark-config '{"key": 42}' --model MODEL --text "..."
    {"score": 61.3, "p_value": 2.1e-07, "num_scored_tokens": 32, "is_watermarked": true}

The p-value is the chance that text sampled without the key scores as much; the text is
watermarked below ``--p-value-threshold`` (0.01). Give the generated text alone (the prompt was
not sampled), and the same ``--watermark-config`` as the server (its key, algorithm, alpha and
context width)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from actors.engine.json_flags import parse_object
from models.watermark import WatermarkConfig, create_detector


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--watermark-config", required=True, metavar="JSON",
                   help="the server's --watermark-config (at least its key)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="the generated text")
    what.add_argument("--file", help="a file holding the generated text ('-': standard input)")
    what.add_argument("--token-ids", metavar="IDS", help="the generated token ids, comma-separated")
    p.add_argument("--model", default=None, help="the model whose tokenizer reads the text (default: the server's "
                                                 "default model)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer to read the text with instead of the model's")
    p.add_argument("--p-value-threshold", type=float, default=0.01, metavar="P",
                   help="the text is watermarked when its p-value is at most this (default: 0.01)")
    args = p.parse_args(argv)
    try:
        args.config = WatermarkConfig.of(parse_object(args.watermark_config, "--watermark-config"))
    except ValueError as exc:
        p.error(str(exc))
    if not 0.0 < args.p_value_threshold < 1.0:
        p.error("--p-value-threshold must be between 0 and 1")
    if args.token_ids is not None:
        try:
            args.ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            p.error(f"--token-ids must be comma-separated integers, got {args.token_ids!r}")
    return args


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        return args.ids
    text = args.text
    if text is None:
        text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    from models.resolve import resolve_model, resolve_tokenizer
    source = resolve_tokenizer(args.tokenizer) or resolve_model(args.model)
    return TextTokenizer.from_source(source.kind, source.path).encode(text, add_special_tokens=False)


def main(argv: list[str] | None = None, prog: str = "python -m tools.detect_watermark") -> int:
    args = parse_args(argv, prog)
    detection = create_detector(args.config, args.p_value_threshold).detect(_token_ids(args))
    print(json.dumps(dataclasses.asdict(detection)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
