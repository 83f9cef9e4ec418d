"""lm-eval tasks shipped with the repository, usable offline from any working directory.

Point lm-eval at this directory (``TaskManager(include_path=TASK_DIRECTORY)``, or ``--include_path`` on its CLI).
The YAML files load their documents through ``bundled_data.py`` (``custom_dataset: !function ...``), which reads
the ``data`` folder beside it, so the current directory does not matter and no ``datasets`` cache is written.

* ``m3_kv_retrieval_short`` / ``m3_kv_retrieval_long``: key-value retrieval, multiple choice over four values
  (``acc``); data from ``make_retrieval.py``.
* ``m3_pd_perplexity``: rolling log-likelihood of public-domain prose (``word_perplexity``, ``byte_perplexity``,
  ``bits_per_byte``).
* tag ``m3_bundled``: all of them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["TASK_DIRECTORY", "BUNDLED_TAG", "bundled_task_names", "load_task_yaml"]

TASK_DIRECTORY = Path(__file__).resolve().parent
BUNDLED_TAG = "m3_bundled"


class _TaskYamlLoader(yaml.SafeLoader):
    """A safe loader that keeps lm-eval's ``!function module.name`` tags as their text."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def _task_files() -> list:
    return sorted(TASK_DIRECTORY.glob("*.yaml"))


def load_task_yaml(path: Path) -> dict:
    """A task YAML as a dict (``!function`` values as ``"!function module.name"`` strings)."""
    with open(path, encoding="utf-8") as handle:
        return yaml.load(handle, Loader=_TaskYamlLoader)


def bundled_task_names() -> list:
    """Names of the bundled tasks (not the tag)."""
    return [load_task_yaml(path)["task"] for path in _task_files()]
