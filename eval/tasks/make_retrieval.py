"""Generate the bundled key-value retrieval data: ``python -m eval.tasks.make_retrieval``.

Each document is a list of ``The value of <key> is <value>.`` lines followed by a question about one key; the
answer is one of four values that all occur in the list, so only reading the queried line (not value frequency
or position) answers it. The queried line's depth runs evenly from the top of the list to the bottom over the
documents of a variant, as in passkey benchmarks, so every part of the context gets retrieved from.

Two variants (``VARIANTS``): ``short`` (24 pairs, a few hundred tokens: beyond the embedded tiny model's top-k
pages, within MiniMax-M3's 16 x 128 = 2048 tokens, where sparse must equal dense) and ``long`` (384 pairs,
about 4K tokens with a 200K-vocabulary tokenizer: beyond M3's 2048-token top-k window, where page selection
matters). The output is deterministic (fixed seeds, no hash-randomised iteration); a test regenerates it and
compares the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..cli import add_debug_argument, run_main
from ..report import checked_output_directory

__all__ = ["VARIANTS", "RetrievalVariant", "make_documents", "write_variant", "run_command", "main", "KV_LINE", "QUESTION", "PREAMBLE"]

DATA_DIRECTORY = Path(__file__).resolve().parent / "data"

ADJECTIVES = (
    "amber", "brisk", "cobalt", "dusty", "eager", "faded", "gentle", "hollow", "ivory", "jolly", "keen", "lunar",
    "mossy", "noble", "olive", "pale", "quiet", "rustic", "silver", "tawny", "upper", "vivid", "windy", "young",
    "azure", "bold", "crimson", "distant", "early", "frosty", "golden", "humble", "icy", "jade", "kind", "little",
    "misty", "narrow", "orange", "proud",
)
NOUNS = (
    "anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel", "umbrella", "valley",
    "walnut", "yarrow", "bridge", "cellar", "desert", "feather", "glacier", "hammer", "icicle", "juniper", "kernel",
    "ladder", "mirror", "nutmeg", "otter", "pillar", "ribbon", "spindle",
)
NUM_CHOICES = 4
PREAMBLE = "Below is a list of keys and their values. Read it carefully: you will be asked for one value.\n"
KV_LINE = "The value of {key} is {value}.\n"
QUESTION = "Question: What is the value of {key}?\nAnswer:"
"""The question the task YAMLs ask after the context (their ``doc_to_text``); the answer follows after a space."""


@dataclass(frozen=True)
class RetrievalVariant:
    name: str
    num_pairs: int
    num_documents: int
    seed: int

    @property
    def path(self) -> Path:
        return DATA_DIRECTORY / f"kv_retrieval_{self.name}.jsonl"


VARIANTS = (
    RetrievalVariant("short", num_pairs=24, num_documents=64, seed=1_000),
    RetrievalVariant("long", num_pairs=384, num_documents=24, seed=2_000),
)


def make_documents(variant: RetrievalVariant) -> list:
    """The variant's documents as dicts: ``context``, ``key``, ``choices`` (value strings), ``answer`` (index),
    ``depth`` (the queried line's relative position, 0 = first line) and ``num_pairs``."""
    if variant.num_pairs < NUM_CHOICES:
        raise ValueError(f"num_pairs must be at least {NUM_CHOICES} (the number of choices), got {variant.num_pairs}")
    if variant.num_pairs > len(ADJECTIVES) * len(NOUNS):
        raise ValueError(f"num_pairs must be at most {len(ADJECTIVES) * len(NOUNS)} distinct keys, got {variant.num_pairs}")
    documents = []
    for index in range(variant.num_documents):
        rng = random.Random(variant.seed + index)
        keys = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], variant.num_pairs)]
        values = [str(v) for v in rng.sample(range(10_000, 100_000), variant.num_pairs)]
        depth_fraction = index / max(1, variant.num_documents - 1)
        queried = round(depth_fraction * (variant.num_pairs - 1))
        distractors = rng.sample([v for i, v in enumerate(values) if i != queried], NUM_CHOICES - 1)
        answer = rng.randrange(NUM_CHOICES)
        choices = distractors[:answer] + [values[queried]] + distractors[answer:]
        lines = "".join(KV_LINE.format(key=key, value=value) for key, value in zip(keys, values))
        documents.append(dict(context=PREAMBLE + lines, key=keys[queried], choices=choices, answer=answer,
                              depth=round(queried / max(1, variant.num_pairs - 1), 4), num_pairs=variant.num_pairs))
    return documents


def render(documents: list) -> str:
    return "".join(json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n" for document in documents)


def write_variant(variant: RetrievalVariant, directory: Path = DATA_DIRECTORY) -> Path:
    path = Path(directory) / variant.path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(make_documents(variant)), encoding="utf-8")
    return path


def run_command(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.tasks.make_retrieval",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--output-dir", type=Path, default=DATA_DIRECTORY,
                        help="where to write the jsonl files (the shipped data by default; existing files are replaced)")
    args = add_debug_argument(parser).parse_args(argv)
    checked_output_directory(args.output_dir, "--output-dir")
    for variant in VARIANTS:
        path = write_variant(variant, args.output_dir)
        print(f"{path}: {variant.num_documents} documents of {variant.num_pairs} pairs ({path.stat().st_size:,} bytes)")


def main(argv=None) -> None:
    run_main(run_command, argv)


if __name__ == "__main__":
    main()
