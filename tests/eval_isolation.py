"""Keeps the eval tests out of the user's home and off the network, and undoes what the runners switch on.

``isolate`` points the embedded model cache, matplotlib's cache and the Hugging Face home into a temporary
directory, and registers the offline switches (environment and the module-level copies that
``eval.offline.enforce_offline`` sets) with the monkeypatch so that they are restored afterwards.
``no_network`` makes every socket connection attempt fail loudly.
"""

import socket
import sys

from eval.offline import OFFLINE_SWITCHES


def isolate(monkeypatch, root):
    monkeypatch.setenv("MINIMAX_M3_EVAL_CACHE", str(root / "eval-cache"))
    monkeypatch.setenv("MPLCONFIGDIR", str(root / "matplotlib"))
    monkeypatch.setenv("HF_HOME", str(root / "hf-home"))
    for name in (*OFFLINE_SWITCHES, "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.setenv(name, "1")  # the runners set "1"; registering it here restores the previous state
    import datasets.config  # noqa: F401  (so its module-level switches exist to be restored)

    for module_name, attributes in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                                    ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        module = sys.modules[module_name]
        for attribute in attributes:
            monkeypatch.setattr(module, attribute, getattr(module, attribute))


class NetworkAccessAttempted(AssertionError):
    pass


def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise NetworkAccessAttempted(f"network access attempted: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
