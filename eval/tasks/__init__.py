"""lm-eval tasks shipped with the repository, usable offline from any working directory.

The YAML files here name their data files relative to this directory (``data/...``); lm-eval's ``json`` loader
would resolve them against the current directory. ``materialize`` writes copies whose ``data_files`` are absolute
(and whose datasets cache is a given directory, so bundled tasks never write into the user's Hugging Face
cache) for ``TaskManager(include_path=...)``.

* ``m3_kv_retrieval_short`` / ``m3_kv_retrieval_long``: key-value retrieval, multiple choice over four values
  (``acc``); data from ``make_retrieval.py``.
* ``m3_pd_perplexity``: rolling log-likelihood of public-domain prose (``word_perplexity``, ``byte_perplexity``,
  ``bits_per_byte``).
* tag ``m3_bundled``: all of them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["TASK_DIRECTORY", "BUNDLED_TAG", "bundled_task_names", "materialize"]

TASK_DIRECTORY = Path(__file__).resolve().parent
BUNDLED_TAG = "m3_bundled"


def _task_files() -> list:
    return sorted(TASK_DIRECTORY.glob("*.yaml"))


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def bundled_task_names() -> list:
    """Names of the bundled tasks (not the tag)."""
    return [_load(path)["task"] for path in _task_files()]


def materialize(destination: Path, dataset_cache_dir: Path) -> Path:
    """Write the bundled task YAMLs into ``destination`` with absolute data paths; return ``destination``.

    ``dataset_cache_dir`` becomes the tasks' ``datasets`` cache (the Arrow files ``load_dataset("json")`` builds).
    """
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for path in _task_files():
        config = _load(path)
        dataset_kwargs = dict(config.get("dataset_kwargs") or {})
        data_files = dataset_kwargs.get("data_files")
        if not isinstance(data_files, dict):
            raise ValueError(f"{path.name}: dataset_kwargs.data_files must map split names to files, got {data_files!r}")
        resolved = {}
        for split, relative in data_files.items():
            absolute = (TASK_DIRECTORY / relative).resolve()
            if not absolute.is_file():
                raise FileNotFoundError(f"{path.name}: data file {relative!r} (split {split!r}) not found at {absolute}")
            resolved[split] = str(absolute)
        dataset_kwargs["data_files"] = resolved
        dataset_kwargs["cache_dir"] = str(Path(dataset_cache_dir).resolve())
        config["dataset_kwargs"] = dataset_kwargs
        with open(destination / path.name, "w", encoding="utf-8") as handle:
            yaml.safe_dump(config, handle, sort_keys=False, allow_unicode=True)
    return destination
