"""The bundled tasks' documents, read from the ``data`` folder beside this file wherever the process runs.

The task YAMLs name these functions as ``custom_dataset: !function bundled_data.<name>``; lm-eval imports this file
from the YAML's own directory and calls the function with the task's metadata as keywords. The documents are built
in memory, so evaluating a bundled task writes no ``datasets`` cache.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIRECTORY = Path(__file__).resolve().parent / "data"


def load_jsonl(file_name: str):
    """A ``DatasetDict`` with one ``test`` split: the documents of ``data/<file_name>``, one JSON object a line."""
    import datasets

    path = DATA_DIRECTORY / file_name
    if not path.is_file():
        raise FileNotFoundError(f"bundled task data {file_name!r} not found at {path} (regenerate it with "
                                f"python -m eval.tasks.make_retrieval, or restore it from git)")
    with open(path, encoding="utf-8") as handle:
        documents = [json.loads(line) for line in handle if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(documents)})


def kv_retrieval_short(**metadata):
    return load_jsonl("kv_retrieval_short.jsonl")


def kv_retrieval_long(**metadata):
    return load_jsonl("kv_retrieval_long.jsonl")


def public_domain(**metadata):
    return load_jsonl("public_domain.jsonl")
