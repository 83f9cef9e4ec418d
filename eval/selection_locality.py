"""How much neighbouring query tokens share their selected pages: ``python -m eval.selection_locality``.

The SM90 sparse-attention kernel (``minimax_m3.sparse_attention_cute``) loads, for each query tile of one KV group,
the union of the pages its tokens selected (8 tokens at M3's 16 query heads per group): its K/V traffic, and so its
speed at long context, grows with that union. Selections drawn independently per token make unions of nearly
``8 x 15`` pages; an indexer that follows the text makes neighbouring tokens pick the same pages. This reports the
mean union per tile for the shipped trained model's indexer (``eval/models/tiny-minimax-m3-retrieval``), the same
model with its indexer re-initialised, and uniform random selections (15 distinct history pages and the local page
per token and group), on the pass-key documents of ``eval.retrieval_accuracy``. Only tiles whose tokens have more
than 16 causal pages count (earlier tokens select every page).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

import torch
from minimax_m3.command_line import positive_ints
from minimax_m3.sparse_attention_cute import page_unions

from . import retrieval_accuracy as ra
from .cli import TOKENIZER_FILES, add_debug_argument, checked_model, run_main
from .devices import checked_device
from .offline import enforce_offline
from .report import checked_output_path, write_json

__all__ = ["uniform_selection", "mean_union_pages", "measure_selection_locality", "locality_table", "run_command",
           "main"]

PAGE = 128
TOPK = 16
VARIANTS = ("sparse", "untrained-indexer", "uniform-random")
TILE_TOKENS = (8, 128)  # the kernel's tile at M3's 16 heads per group; a FlexAttention query block


def uniform_selection(num_tokens: int, num_groups: int, generator: torch.Generator) -> torch.Tensor:
    """``[T, G, 16]`` int32: per token and group, 15 distinct uniform history pages and the local page last;
    tokens with at most 16 causal pages select them all (``-1`` padding), as the contract does."""
    local = torch.arange(num_tokens) // PAGE
    pages = torch.arange(max(1, int(local.max())))
    draws = torch.rand(num_tokens, num_groups, pages.numel(), generator=generator)
    draws = torch.where(pages < local[:, None, None], draws, 2.0)  # only pages before the token's own
    history = draws.argsort(-1)[..., : TOPK - 1]
    few = local < TOPK
    every = torch.arange(TOPK - 1).expand(num_tokens, num_groups, -1)
    history = torch.where(few[:, None, None], torch.where(every < local[:, None, None], every, -1), history)
    return torch.cat([history, local[:, None, None].expand(-1, num_groups, 1)], -1).to(torch.int32)


def mean_union_pages(selection: torch.Tensor, tokens_per_tile: int) -> float:
    """Mean distinct pages per ``tokens_per_tile``-token tile of one sequence's ``[T, G, 16]`` selection, over the
    tiles whose first token has more than 16 causal pages, and over groups."""
    num_tokens = selection.shape[0]
    first_tile = -(-TOPK * PAGE // tokens_per_tile)
    if num_tokens <= first_tile * tokens_per_tile:
        raise ValueError(f"the sequence must be longer than {first_tile * tokens_per_tile} tokens, got {num_tokens}")
    batch_index = torch.zeros(num_tokens, dtype=torch.int32, device=selection.device)
    _, count = page_unions(selection.to(torch.int32), batch_index, -(-num_tokens // PAGE), tokens_per_tile)
    whole_tiles = num_tokens // tokens_per_tile
    return float(count[first_tile:whole_tiles].float().mean())


def _model_selections(model, input_ids: torch.Tensor) -> list:
    with torch.no_grad():
        output = model(input_ids, output_page_selections=True, logits_to_keep=1)
    return [selection[0] for selection in output.page_selections]  # per sparse layer, [T, G, 16]


def measure_selection_locality(model, tokenizer, *, lengths: Sequence[int], documents: int = 1,
                               tiles: Sequence[int] = TILE_TOKENS, seed: int = ra.SEED,
                               on_progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Mean union pages per tile, per length, variant, sparse layer (the model's layer index) and tile size, averaged
    over documents. ``on_progress`` gets the results so far (``"partial": True``) as each length but the last
    completes, so an interrupted run keeps them."""
    device = next(model.parameters()).device
    sparse_layers = [index for index, layer in enumerate(model.model.layers) if layer.self_attn.is_sparse]
    rows = []
    for position_of_length, length in enumerate(lengths):
        for document in ra.make_documents(tokenizer, length, documents, seed=seed, tasks=("passkey",)):
            input_ids = tokenizer(document["context"], return_tensors="pt").input_ids.to(device)
            for name in VARIANTS:
                if name == "uniform-random":
                    generator = torch.Generator().manual_seed(seed + document["doc_id"])
                    groups = model.config.num_key_value_heads
                    selections = [uniform_selection(input_ids.shape[1], groups, generator)]
                else:
                    with ra.variant(model, name, seed=seed):
                        selections = _model_selections(model, input_ids)
                for position, selection in enumerate(selections):
                    layer = None if name == "uniform-random" else sparse_layers[position]
                    for tile in tiles:
                        rows.append(dict(length=length, doc_id=document["doc_id"], tokens=input_ids.shape[1],
                                         variant=name, layer=layer,
                                         tile_tokens=tile, mean_union_pages=mean_union_pages(selection.cpu(), tile)))
        if on_progress is not None and position_of_length < len(lengths) - 1:
            on_progress({"partial": True, **_summarized(rows)})
    return _summarized(rows)


def _summarized(rows: list) -> dict:
    summary = {}
    for row in rows:
        key = (row["length"], row["variant"], row["layer"], row["tile_tokens"])
        summary.setdefault(key, []).append(row["mean_union_pages"])
    return {"rows": list(rows), "summary": [dict(length=k[0], variant=k[1], layer=k[2], tile_tokens=k[3],
                                                 mean_union_pages=sum(v) / len(v), documents=len(v))
                                            for k, v in summary.items()]}


def locality_table(result: dict) -> str:
    lines = ["| length | variant | layer | tile tokens | mean union pages per tile | of at most |",
             "|---|---|---|---|---|---|"]
    for row in result["summary"]:
        layer = "-" if row["layer"] is None else str(row["layer"])
        lines.append(f"| {row['length']} | {row['variant']} | {layer} | {row['tile_tokens']} | "
                     f"{row['mean_union_pages']:.1f} | {row['tile_tokens'] * TOPK} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.selection_locality",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped trained tiny model)")
    parser.add_argument("--lengths", type=positive_ints, default=(8192, 32768),
                        help="comma-separated document lengths in tokens (each > 2048)")
    parser.add_argument("--documents", type=int, default=1, help="pass-key documents per length")
    parser.add_argument("--tiles", type=positive_ints, default=TILE_TOKENS, help="tile sizes in tokens")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: CUDA when available)")
    parser.add_argument("--output", default=None, help="JSON results path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return add_debug_argument(parser)


def run_command(argv: Optional[Sequence[str]] = None) -> dict:
    """The command line's work; returns the results (``main`` is the command-line entry point)."""
    args = build_parser().parse_args(argv)
    if args.documents < 1:
        raise SystemExit(f"--documents must be at least 1, got {args.documents}")
    if min(args.lengths) <= TOPK * PAGE + max(args.tiles):
        raise SystemExit(f"--lengths must exceed {TOPK * PAGE + max(args.tiles)} tokens (16 pages and a tile)")
    device = checked_device(args.device)
    output = None if args.output is None else checked_output_path(args.output, "selection_locality",
                                                                   overwrite=args.overwrite)
    if args.model is not None:
        checked_model(args.model)
        checked_model(args.model, files=TOKENIZER_FILES)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import minimax_m3  # noqa: F401  (registers the Auto classes)
    from .trained_model import trained_model_dir

    enforce_offline()
    path = args.model or str(trained_model_dir())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    flushed = []

    def flush(partial: dict) -> None:  # each finished length, atomically: an interrupted run keeps them
        if output is not None:
            flushed.append(write_json(output, {**partial, "model": path}))

    try:
        result = measure_selection_locality(model, tokenizer, lengths=args.lengths, documents=args.documents,
                                            tiles=args.tiles, on_progress=flush)
    except KeyboardInterrupt:
        saved = f"the finished lengths are in {output} (\"partial\": true)" if flushed else "no length had finished"
        print(f"\ninterrupted: {saved}", file=sys.stderr)
        raise SystemExit(130) from None
    result["model"] = path
    result["partial"] = False
    print(locality_table(result))
    if output is not None:
        write_json(output, result)
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    return run_main(run_command, argv)


if __name__ == "__main__":
    main()
